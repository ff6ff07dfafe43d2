"""`python -m kvscope.app`: the `kvscope` command."""

from kvscope.app.cli import main

raise SystemExit(main())

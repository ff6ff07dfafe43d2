"""`python -m kvscope.app`: the `kvscope` command."""

from kvscope.app.cli.main import main

raise SystemExit(main())

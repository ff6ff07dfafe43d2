"""The `kvscope` command line."""


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("kvscope: not implemented yet")

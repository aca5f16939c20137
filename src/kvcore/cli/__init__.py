"""The `kvcore` console script: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module under kvcore.cli; each module has add_arguments(parser) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "plan": "plan",
    "generate": "generate",
    "pull": "pull",
    "convert": "convert",
    "serve": "serve",
    "eval": "eval",
}


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcore", description="kvcore LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"kvcore.cli.{module_name}")
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0] if module.__doc__ else None)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except CLIError as e:
        print(f"kvcore {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

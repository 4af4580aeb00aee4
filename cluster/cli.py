"""`specserve` command line: dispatches to one module per subcommand in ``cluster.commands``.

Each command module exposes ``add_parser(subparsers)`` (registering its arguments and setting
``func``) so that adding a command never edits another command's code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand module names under cluster.commands (bench has its own sub-subcommands)
COMMANDS = ("generate", "bench", "serve", "client", "map", "train_draft", "suffix_corpus", "export_head")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"cluster.commands.{name}")
        except ModuleNotFoundError as exc:  # a command whose module is not present yet
            if exc.name != f"cluster.commands.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one clear error line, not a traceback, for user errors
        from cluster.common.errors import is_user_facing

        if is_user_facing(exc):
            print(f"specserve: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

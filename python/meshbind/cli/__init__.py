"""The meshbind command line: demo, bench, check, plan.

Help and argument errors answer before torch is imported; a command imports what it runs."""

from __future__ import annotations

import sys
from collections.abc import Sequence

INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C, as a shell gives one stopped by SIGINT."""


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        return _command(arguments)
    except KeyboardInterrupt:  # also while torch is being imported
        command = f"meshbind {arguments[0]}" if arguments else "meshbind"
        print(f"{command}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _command(arguments: list[str]) -> int:
    from meshbind.cli.arguments import UsageError, command_parser, demo_parser

    if arguments[:1] == ["demo"]:
        demo_args = demo_parser().parse_args(arguments[1:])
        from meshbind.cli.commands import demo

        return demo(demo_args)
    args = command_parser().parse_args(arguments)
    from meshbind.cli import commands
    from meshbind.cli.plan import plan

    run = {"check": commands.check, "bench": commands.bench, "plan": plan}[args.command]
    try:
        return run(args)
    except (UsageError, ValueError, TypeError) as error:
        print(f"meshbind {args.command}: {error}", file=sys.stderr)
        return 2

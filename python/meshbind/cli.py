"""The ``meshbind`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from meshbind import PatternSet
from meshbind.examples.moe_tree import DEEP_PLAN, build_moe_tree


def _demo(args: argparse.Namespace) -> int:
    """Match the deep plan over an embedded MoE tree and report what each pattern selects."""
    print(f"building a {args.layers}x{args.experts} MoE tree on meta ...", file=sys.stderr)
    model = build_moe_tree(args.layers, args.experts)
    started = time.perf_counter()
    patterns = PatternSet(DEEP_PLAN)
    tree = patterns.walk(model)
    counts = tree.hit_counts(len(patterns))
    unmatched = [p for p, c in zip(DEEP_PLAN, counts, strict=False) if c == 0]
    elapsed = time.perf_counter() - started
    rows = [{"pattern": p, "matches": c} for p, c in zip(DEEP_PLAN, counts, strict=False)]
    if args.json:
        print(json.dumps({"modules_matched": len(tree), "seconds": elapsed, "patterns": rows}))
    else:
        width = max(len(p) for p in DEEP_PLAN)
        for row in rows:
            print(f"{row['pattern']:<{width}}  {row['matches']:>8}")
        print(f"{len(tree)} FQNs matched in {elapsed * 1e3:.1f} ms")
    if unmatched:
        print(f"patterns selecting nothing: {unmatched}", file=sys.stderr)
        return 1
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshbind", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="match the embedded deep plan over a built-in MoE tree")
    demo.add_argument("--layers", type=_positive, default=8)
    demo.add_argument("--experts", type=_positive, default=64)
    demo.add_argument("--json", action="store_true", help="one JSON object on stdout")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

"""How close `meshbind_validate` can come to `meshbind`: the least Python work any resolution must
add to the match (see `validation_floor` in meshbind/bench.py), timed side by side with both.

    python benches/validation_floor.py --size 61x1024 --plan moe

Whatever does the rest of resolution and validation (Rust or Python), `meshbind_validate` cannot be
faster than `floor`, so `floor / meshbind` bounds the ratio the `moe` bar asks of it.
"""

import argparse
import functools
import sys

from meshbind.bench import FUSED_EXPERT_PLANS, PLANS, Size, meshbind_resolution, meshbind_validate, time_method, validation_floor
from meshbind.examples.moe_tree import build_moe_tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="61x1024", type=Size.parse)
    parser.add_argument("--plan", default="moe", choices=sorted(PLANS))
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    tree = build_moe_tree(args.size.layers, args.size.experts, fused_experts=args.plan in FUSED_EXPERT_PLANS)
    plan = PLANS[args.plan](args.size.layers)
    times = {}
    for method in (meshbind_resolution, validation_floor, meshbind_validate):
        median, _, outcome = time_method(functools.partial(method, tree, plan), args.repeat)
        times[method] = median
        print(f"{args.size.label} {args.plan}  {method.__name__:<20} {median * 1e3:9.3f} ms  {outcome.matches} planned modules")
    for method in (validation_floor, meshbind_validate):
        print(f"{method.__name__} / meshbind = {times[method] / times[meshbind_resolution]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

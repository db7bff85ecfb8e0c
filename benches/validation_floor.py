"""How close `meshbind_validate` can come to `meshbind`: the least Python work any resolution must
add to the match (see `validation_floor` in meshbind/bench.py), timed side by side with both.

    python benches/validation_floor.py --size 61x1024 --plan moe

Whatever does the rest of resolution and validation (Rust or Python), `meshbind_validate` cannot be
faster than `validation_floor`, so `validation_floor / meshbind` bounds the ratio the `moe` bar asks
of it. `required_calls_floor` is the bound for any resolution at all: the match and the user code
SPEC makes it call, nothing else, with the requests built before the clock starts.
"""

import argparse
import functools
import sys

from meshbind.bench import (
    FUSED_EXPERT_PLANS,
    PLANS,
    Size,
    meshbind_resolution,
    meshbind_validate,
    required_calls_floor,
    time_method,
    validation_floor,
    validation_requests,
)
from meshbind.examples.moe_tree import build_moe_tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="61x1024", type=Size.parse)
    parser.add_argument("--plan", default="moe", choices=sorted(PLANS))
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    tree = build_moe_tree(args.size.layers, args.size.experts, fused_experts=args.plan in FUSED_EXPERT_PLANS)
    plan = PLANS[args.plan](args.size.layers)
    requests = validation_requests(tree, plan)
    runs = {
        "meshbind": functools.partial(meshbind_resolution, tree, plan),
        "required_calls_floor": functools.partial(required_calls_floor, tree, plan, requests),
        "validation_floor": functools.partial(validation_floor, tree, plan),
        "meshbind_validate": functools.partial(meshbind_validate, tree, plan),
    }
    times = {}
    for name, run in runs.items():
        median, _, outcome = time_method(run, args.repeat)
        times[name] = median
        print(f"{args.size.label} {args.plan}  {name:<20} {median * 1e3:9.3f} ms  {outcome.matches} planned modules")
    for name in list(runs)[1:]:
        print(f"{name} / meshbind = {times[name] / times['meshbind']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

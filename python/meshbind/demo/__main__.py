"""``torchrun -m meshbind.demo``: the distributed half, the world from torchrun's environment."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

import meshbind.demo
from meshbind.demo.checks import FlagError, check_flags
from meshbind.demo.config import add_flags, config_from
from meshbind.demo.output import print_report
from meshbind.demo.run import run_rank


def torchrun_main(argv: Sequence[str] | None = None) -> int:
    """``torchrun -m meshbind.demo``: the world comes from torchrun's environment; NCCL on GPUs."""
    parser = argparse.ArgumentParser(
        prog="python -m meshbind.demo", description=meshbind.demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(parser, world_size=False)
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        parser.error("run me under torchrun (WORLD_SIZE is not set); `meshbind demo` spawns a local world itself")
    config = config_from(args, int(os.environ["WORLD_SIZE"]))
    try:
        check_flags(config)
    except FlagError as error:
        print(f"meshbind demo: {error}", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        report = run_rank(config)
    finally:
        dist.destroy_process_group()
    if report is not None:
        print_report(report, config.json)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main())

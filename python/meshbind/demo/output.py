"""The demo's report as a reader sees it: the plan, the world, the timings and how far the run
is from the one-process reference; ``--json`` ends it with one JSON object."""

from __future__ import annotations

import json
from typing import Any


def print_report(report: dict[str, Any], as_json: bool) -> None:
    print(report["plan"])
    print()
    precision = f", computed in {report['param_dtype']} (FSDP2 mixed precision)" if report["param_dtype"] else ""
    print(f"world: {report['world_size']} ranks, axes {report['axis_sizes']}, {report['dtype']}{precision}")
    if report["pipeline"] is not None:
        print(report["pipeline"])
    print(f"modules bound on rank 0: {report['modules_bound']} of {report['planned_modules']} planned")
    print(f"new process groups while applying layouts and binding: {report['new_process_groups']}")
    print("phases (rank 0): " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in report["phases"].items()))
    print(
        f"loss {report['loss']:.10g} vs reference {report['reference_loss']:.10g}: "
        f"max |loss diff| {report['max_abs_loss_diff']:.3e}"
    )
    print(f"max relative gradient difference over all parameters: {report['max_rel_grad_diff']:.3e}")
    if report["cast_rel_grad_diff"] is not None:
        print(
            f"  the reference runs the same casts; those casts alone move its gradients by {report['cast_rel_grad_diff']:.3e} "
            f"from {report['dtype']}: the distributed run, rounding in another order, differs by about as much"
        )
    parts = ", ".join(f"{part} {mine} of {full}" for part, (mine, full) in report["param_bytes_by_part"].items())
    print(f"parameter bytes: {report['param_bytes_per_rank']} on rank 0 of {report['param_bytes_full']} in one process ({parts})")
    matches = "equal on every rank" if report["report_matches_every_rank"] else "DIFFERENT on some rank"
    print(f"plan_report, before any weight existed: {report['report_param_bytes_per_rank']} bytes on rank 0 ({matches})")
    if "loss_after_step" in report:
        print(f"after one SGD step: loss {report['loss_after_step']:.10g}; state saved to {report['saved_to']}")
    if as_json:
        print(json.dumps({key: value for key, value in report.items() if key != "plan"}))

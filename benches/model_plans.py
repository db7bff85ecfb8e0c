"""Resolving the stock plans of real model skeletons, against what transformers and torch do for them.

    python benches/model_plans.py --repeat 5 --runs 3

Each skeleton is built once on ``meta`` at its real size (transformers' Llama-3 70B, Mixtral 8x7B,
Qwen3-30B-A3B, DeepSeek-V3; torchtitan's llama3 405B and deepseek_v3 671B, from tests/) and each
method is timed on it side by side, in one run:

- ``meshbind``: ``resolve_plan`` of ``from_hf_plan`` (transformers models) or ``from_torch_plan``
  (torchtitan models, with the plans torchtitan writes): every key matched, every placement and
  config fact checked;
- ``transformers``: the model's own ``_resolve_parallel_plans`` (expansion to exact names, its key
  checks; no size checks);
- ``torch``: ``parallelize_module``'s key resolution of the same keys with a style that only records
  the modules it is handed (nothing is sharded; torch warns about keys that select nothing).

A method's time is the median of ``--repeat`` calls; ``--runs`` whole runs give the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resolution_methods import RecordingStyle
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from meshbind import LayoutContext, from_hf_plan, from_torch_plan, resolve_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_models import hf_model
from torchtitan_plans import deepseek_v3_plan, llama3_plan, torchtitan_model


def _hf(name: str, axes: dict[str, int]) -> tuple[nn.Module, dict[str, Callable[[], object]]]:
    from transformers.distributed.configuration_utils import DistributedConfig

    model = hf_model(name, real=True)
    context = LayoutContext(axes)
    tp, ep = axes.get("tp", 1), axes.get("ep", 1)
    config = DistributedConfig(tp_size=tp, ep_size=ep, fsdp_size=max(ep // tp, 1))
    keys = [*model.tp_plan, *model.ep_plan]
    return model, {
        "meshbind": lambda: resolve_plan(model, from_hf_plan(model), context),
        "transformers": lambda: model._resolve_parallel_plans(config),
        "torch": lambda: _torch_resolution(model, keys),
    }


def _torchtitan(name: str, flavor: str, plan: dict[str, Any], tp: int) -> tuple[nn.Module, dict[str, Callable[[], object]]]:
    model = torchtitan_model(name, flavor)
    context = LayoutContext({"tp": tp})
    return model, {
        "meshbind": lambda: resolve_plan(model, from_torch_plan(plan), context),
        "torch": lambda: _torch_resolution(model, list(plan)),
    }


def _torch_resolution(model: nn.Module, keys: list[str]) -> list[nn.Module]:
    seen: list[nn.Module] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallelize_module(model, object(), dict.fromkeys(keys, RecordingStyle(seen)))  # type: ignore[arg-type]
    return seen


SKELETONS: dict[str, Callable[[], tuple[nn.Module, dict[str, Callable[[], object]]]]] = {
    "Llama-3 70B (HF), tp=8": lambda: _hf("llama", {"tp": 8}),
    "Mixtral 8x7B (HF), tp=8 ep=8": lambda: _hf("mixtral", {"tp": 8, "ep": 8}),
    "Qwen3-30B-A3B (HF), dp_shard=2 tp=4 ep=8": lambda: _hf("qwen3_moe", {"dp_shard": 2, "tp": 4, "ep": 8}),
    "DeepSeek-V3 (HF), tp=8 ep=8": lambda: _hf("deepseek_v3", {"tp": 8, "ep": 8}),
    "llama3 405B (torchtitan), tp=8": lambda: _torchtitan("llama3", "405B", llama3_plan(), 8),
    "deepseek_v3 671B (torchtitan), tp=8": lambda: _torchtitan("deepseek_v3", "671B", deepseek_v3_plan(q_lora=True), 8),
}


def median_seconds(call: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="calls per method and run (median)")
    parser.add_argument("--runs", type=int, default=3, help="whole runs (median ratio)")
    args = parser.parse_args(argv)
    print("| skeleton | modules | meshbind | transformers | torch | transformers / meshbind | torch / meshbind |")
    print("|---|---|---|---|---|---|---|")
    for label, build in SKELETONS.items():
        model, methods = build()
        modules = sum(1 for _ in model.named_modules())
        runs = [{name: median_seconds(call, args.repeat) for name, call in methods.items()} for _ in range(args.runs)]
        cells = [
            f"{statistics.median(run[name] for run in runs) * 1e3:.1f} ms" if name in methods else "—"
            for name in ("meshbind", "transformers", "torch")
        ]
        ratios = [
            f"{statistics.median(run[name] / run['meshbind'] for run in runs):.1f}x" if name in methods else "—"
            for name in ("transformers", "torch")
        ]
        print(f"| {label} | {modules} | " + " | ".join(cells + ratios) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

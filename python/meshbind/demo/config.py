"""The demo's flags and what they configure, read without importing torch (``meshbind demo
--help`` and a bad flag answer at once)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshbind.world import World

if TYPE_CHECKING:
    from meshbind.examples.moe_transformer import TransformerConfig

DTYPES = ("float32", "float64")
"""The dtypes the demo runs in."""
LOW_PRECISION = ("bf16", "bfloat16", "fp16", "float16")
"""What ``--param-dtype`` takes: the low-precision names of ``names.DTYPE_NAMES``."""


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 4
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    """The microbatches of one step under a pipeline (default: one per stage)."""
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 2
    tp: int = 2
    ep: int = 2
    layers: int = 2
    experts: int = 8
    seq_len: int = 32
    batch: int = 4
    dtype: str = "float32"
    param_dtype: str | None = None
    """FSDP2 mixed precision: what each unit is gathered and computed in (gradients reduced in
    float32); ``None`` computes in ``dtype``."""
    seed: int = 0
    json: bool = False
    save: str | None = None
    """A directory: after the backward, one SGD step, then the model's state saved there."""
    load: str | None = None
    """A directory saved by ``--save`` (at any layout): the model's state, in place of the seeded init."""
    allow_unverified: bool = False
    """Load ``load`` even when its manifest is gone (its files cannot be verified)."""
    lr: float = 0.1

    @property
    def transformer(self) -> TransformerConfig:
        from meshbind.examples.moe_transformer import TransformerConfig  # torch: imported once a demo runs

        return TransformerConfig(layers=self.layers, experts=self.experts)

    @property
    def fsdp(self) -> bool:
        """FSDP (HSDP with ``dp_replicate`` above 1) when ``dp_shard`` is above 1; otherwise the
        data-parallel ranks replicate, and the demo sums their gradients itself."""
        return self.dp_shard > 1

    @property
    def batch_shards(self) -> int:
        """The ranks the batch is split over: every data-parallel rank, replicated or sharded."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> World:
        return World(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp, ep=self.ep)


def add_flags(parser: argparse.ArgumentParser, *, world_size: bool) -> None:
    defaults = DemoConfig()
    if world_size:
        parser.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks to spawn (gloo)")
    parser.add_argument("--pp", type=int, default=defaults.pp, help="pipeline stages of ranks (outermost axis)")
    parser.add_argument(
        "--pp-schedule", default=defaults.pp_schedule, help="torch's pipeline schedule (1F1B, GPipe, Interleaved1F1B, ...)"
    )
    parser.add_argument("--pp-microbatches", type=int, help="microbatches per step under --pp (default: one per stage)")
    parser.add_argument(
        "--dp-replicate", "--dp", type=int, default=defaults.dp_replicate, help="data-parallel ranks that replicate (HSDP's)"
    )
    parser.add_argument(
        "--dp-shard", type=int, default=defaults.dp_shard, help="data-parallel ranks FSDP shards over (above 1: FSDP2)"
    )
    for name in ("cp", "tp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name), help=f"{name} axis size")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="global batch (split over dp_replicate x dp_shard)")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    parser.add_argument(
        "--param-dtype",
        choices=LOW_PRECISION,
        help="FSDP2 mixed precision (needs --dp-shard above 1): gather and compute in it, reduce gradients in float32",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    parser.add_argument("--save", metavar="DIR", help="after the backward, one SGD step, then save the state to DIR")
    parser.add_argument("--load", metavar="DIR", help="load the state saved by --save (at any layout) instead of the seeded init")
    parser.add_argument(
        "--allow-unverified", action="store_true", help="--load a checkpoint whose manifest is gone (unverifiable)"
    )
    parser.add_argument("--lr", type=float, default=defaults.lr, help="the learning rate of --save's step")


def config_from(args: argparse.Namespace, world_size: int) -> DemoConfig:
    fields = {name: getattr(args, name) for name in DemoConfig.__dataclass_fields__ if name != "world_size"}
    return DemoConfig(world_size=world_size, **fields)

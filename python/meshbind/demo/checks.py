"""Every rule the demo's flags must keep, checked before any process starts."""

from __future__ import annotations

import math
import os

from meshbind._core import not_divisible
from meshbind.checkpoints import save_target_problem
from meshbind.demo.config import DemoConfig
from meshbind.world import DENSE_AXES, PIPELINE_AXIS


class FlagError(ValueError):
    """A demo flag that cannot work; raised before any process starts."""


LIMITS = {"layers": 64, "experts": 1024, "seq_len": 65536, "batch": 4096}
"""The demo's largest model and batch: a small model run on this machine's CPU, every rank and a
one-process reference holding it whole (beyond, it runs out of memory or time)."""
MAX_TOKENS = 2**20
"""The most tokens one demo batch may hold (``batch * seq_len``)."""


def check_flags(config: DemoConfig, cpu_count: int | None = None) -> None:
    """Every flag rule, each failure one line."""
    cores = cpu_count or os.cpu_count() or 1
    for name in ("world_size", "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "layers", "experts", "seq_len", "batch"):
        if getattr(config, name) < 1:
            raise FlagError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    for name, limit in LIMITS.items():
        if getattr(config, name) > limit:
            raise FlagError(f"--{name.replace('_', '-')} {getattr(config, name)} is over the demo's limit of {limit}")
    if config.batch * config.seq_len > MAX_TOKENS:
        raise FlagError(
            f"--batch {config.batch} x --seq-len {config.seq_len} is {config.batch * config.seq_len:,} tokens, "
            f"over the demo's limit of {MAX_TOKENS:,}"
        )
    if not 0 <= config.seed < 2**63:
        raise FlagError(f"--seed {config.seed} must be from 0 to 2**63 - 1")
    if not math.isfinite(config.lr) or config.lr <= 0:
        raise FlagError(f"--lr {config.lr} must be a positive, finite learning rate")
    if config.world_size > 4 * cores:
        raise FlagError(
            f"a world of {config.world_size} ranks is more than this machine can sensibly run "
            f"({cores} cores: at most {4 * cores})"
        )
    try:
        world = config.world
    except ValueError as error:
        raise FlagError(str(error)) from None
    if world.size != config.world_size:
        product = " x ".join(f"--{axis.replace('_', '-')} {getattr(config, axis)}" for axis in (PIPELINE_AXIS, *DENSE_AXES))
        raise FlagError(f"{product} = {world.size}, not the world size {config.world_size}")
    if (problem := not_divisible("--experts", config.experts, "ep", config.ep)) is not None:
        raise FlagError(problem)
    if config.experts < config.transformer.top_k:
        raise FlagError(
            f"--experts {config.experts} is fewer than the {config.transformer.top_k} experts each token is routed to"
        )
    if (problem := not_divisible("the model's attention heads", config.transformer.heads, "tp", config.tp)) is not None:
        raise FlagError(problem)
    if config.seq_len % (2 * config.cp):
        raise FlagError(f"--seq-len {config.seq_len} is not divisible by 2 x --cp = {2 * config.cp} (head-tail CP chunks)")
    if config.param_dtype is not None and not config.fsdp:
        raise FlagError(f"--param-dtype {config.param_dtype} is FSDP2's mixed precision: it needs --dp-shard above 1")
    if config.batch % config.batch_shards:
        raise FlagError(
            f"--batch {config.batch} is not divisible by --dp-replicate x --dp-shard = {config.batch_shards} (the batch's split)"
        )
    if config.pp > 1:
        _check_pipeline(config)
    if config.load is not None and not os.path.isfile(os.path.join(config.load, ".metadata")):
        raise FlagError(f"--load {config.load} is not a checkpoint written by --save (no .metadata in it)")
    if config.save is not None and (refused := save_target_problem(config.save)) is not None:
        raise FlagError(f"--save {refused}")


def _check_pipeline(config: DemoConfig) -> None:
    """The pipeline's rules, as ``split_stages`` checks them on the demo's model (on ``meta``)."""
    from meshbind.pipeline import schedule_named  # torch: imported only for a pipeline

    try:
        schedule = schedule_named(config.pp_schedule, "--pp-schedule")
    except ValueError as error:
        raise FlagError(str(error)) from None
    stages = config.pp * schedule.default_stages_per_rank()
    if stages > config.layers + 2:  # the embedding and the head weigh as a block each, as torchtitan splits
        raise FlagError(
            f"--pp {config.pp} with {schedule.name} makes {stages} stages, more than --layers {config.layers} blocks "
            "and the embedding and head"
        )
    microbatches = config.pp_microbatches if config.pp_microbatches is not None else stages
    if microbatches < 1:
        raise FlagError(f"--pp-microbatches must be at least 1, got {microbatches}")
    per_rank = config.batch // config.batch_shards
    if per_rank % microbatches:
        raise FlagError(
            f"each data-parallel rank's {per_rank} sequences (--batch {config.batch} over {config.batch_shards}) do not "
            f"split into {microbatches} microbatches"
        )
    problems = schedule.problems(config.pp, stages, microbatches)
    if problems:
        raise FlagError("; ".join(problems))

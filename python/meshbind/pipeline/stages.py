"""The pipeline's stages, split as torchtitan splits them, from the model index alone (on
``meta``, before any weight exists).

A stage is a list of module FQNs, each kept whole with its full FQN: blocks of the model's layer
list, and the modules around the list (the embeddings before it go to the first stage; the final
norm and head after it to the last). Around the list means the siblings of the list and of each
module holding it, in the order they were registered; one that holds no parameter (a rotary
embedding's tables) is kept in every stage. By default the blocks are spread evenly over the
stages, the first stage counting its input modules as ``first_stage_less_layers`` blocks and the
last its output modules as ``last_stage_less_layers`` (torchtitan's
``generate_llm_fqn_per_model_part``); ``layers_per_stage`` sets the number of stages from it, and
``stage_modules`` gives each stage's FQNs outright.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from meshbind.errors import PipelineError
from meshbind.model_index import ModelIndex
from meshbind.pipeline.schedules import RunOrder, Schedule, in_flight, run_order, schedule_named
from meshbind.units import is_int_from


@dataclass(frozen=True)
class Pipeline:
    """What a pipeline is asked to be (the ``pp`` axis gives its ranks): torch's schedule by name,
    the microbatches of one step (default: one per stage), and how the model splits."""

    schedule: str = "1F1B"
    microbatches: int | None = None
    layers_per_stage: int | None = None
    first_stage_less_layers: int = 1
    last_stage_less_layers: int = 1
    stage_modules: Sequence[Sequence[str]] | None = None


@dataclass(frozen=True)
class PipelineStages:
    """The split a ``Pipeline`` makes of one model over ``pp`` ranks: each stage's module FQNs
    (``stages[i]``), the parameter-free modules every stage keeps, the schedule and microbatches."""

    pp: int
    schedule: Schedule
    microbatches: int
    stages: tuple[tuple[str, ...], ...]
    everywhere: tuple[str, ...]

    @cached_property
    def order(self) -> RunOrder:
        """Each pipeline rank's actions in the order torch runs them (``run_order``)."""
        return run_order(self.schedule, self.pp, len(self.stages), self.microbatches)

    @cached_property
    def in_flight(self) -> tuple[int, ...]:
        """Each stage's most microbatches in flight (forward run, backward not yet), in torch's order."""
        return in_flight(self.order, len(self.stages))

    def stages_of_rank(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` runs (torch's placement for the schedule)."""
        return self.schedule.stages_on_rank(pp_rank, self.pp, len(self.stages))

    def keeps(self, stage: int) -> Callable[[str], bool]:
        """Whether a module FQN of the whole model is in stage ``stage``'s model: one of its
        modules, inside one, or holding one (the containers on the way down)."""
        roots = (*self.stages[stage], *self.everywhere)

        def keep(fqn: str) -> bool:
            return any(_within(fqn, root) or _within(root, fqn) for root in roots)

        return keep

    def holders(self) -> Callable[[str], str]:
        """Which stage holds a state-dict entry (a parameter or buffer under its full FQN):
        ``stage 3``, or ``every stage`` for one of the modules each stage keeps."""
        held = {root: f"stage {index}" for index, roots in enumerate(self.stages) for root in roots}
        held.update(dict.fromkeys(self.everywhere, "every stage"))

        def holder(key: str) -> str:
            parts = key.split(".")
            for end in range(len(parts) - 1, -1, -1):
                if (found := held.get(".".join(parts[:end]))) is not None:
                    return found
            raise ValueError(f"no pipeline stage holds {key!r}")

        return holder

    def to_dict(self) -> dict[str, object]:
        return {
            "pp": self.pp,
            "schedule": self.schedule.name,
            "microbatches": self.microbatches,
            "stages": [
                {"modules": list(modules), "pp_rank": self.rank_of(index), "in_flight": self.in_flight[index]}
                for index, modules in enumerate(self.stages)
            ],
            "everywhere": list(self.everywhere),
        }

    def text(self) -> str:
        lines = [f"pipeline: {len(self.stages)} stages over pp={self.pp}, {self.schedule.name}, {self.microbatches} microbatches"]
        for index, modules in enumerate(self.stages):
            held = f", up to {self.in_flight[index]} microbatch{'es' if self.in_flight[index] != 1 else ''} in flight"
            lines.append(f"  stage {index} (pp rank {self.rank_of(index)}{held}): {_ranges(modules)}")
        return "\n".join(lines)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs stage ``stage``."""
        return next(rank for rank in range(self.pp) if stage in self.stages_of_rank(rank))


def stages_text(stages: Sequence[int]) -> str:
    """``stage 3`` or ``stages 3, 28``: how an answer names a rank's stages."""
    return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def split_stages(index: ModelIndex, pp: int, pipeline: Pipeline, *, check_order: bool = True) -> PipelineStages:
    """The stages of the indexed model over ``pp`` ranks, or a ``PipelineError`` listing every
    problem (the schedule's needs, too few blocks, a module no stage or two stages hold). Without
    ``check_order`` torch's own checks of the schedule wait for ``order_checked``."""
    problems: list[str] = []
    schedule = schedule_named(pipeline.schedule, "the pipeline schedule")
    for name in ("layers_per_stage", "microbatches"):
        value = getattr(pipeline, name)
        if value is not None and not is_int_from(value, 1):
            problems.append(f"{name} must be an int from 1, got {value!r}")
    for name in ("first_stage_less_layers", "last_stage_less_layers"):
        if not is_int_from(getattr(pipeline, name), 0):
            problems.append(f"{name} must be an int from 0, got {getattr(pipeline, name)!r}")
    if problems:
        raise PipelineError(problems)
    parts = _model_parts(index)
    if pipeline.stage_modules is not None:
        stages = tuple(tuple(modules) for modules in pipeline.stage_modules)
        problems += _coverage_problems(index, stages, parts.everywhere)
    else:
        count = _stage_count(pp, schedule, pipeline, len(parts.blocks), problems)
        stages = _even_split(parts, count, pipeline, problems) if not problems else ()
    microbatches = pipeline.microbatches if pipeline.microbatches is not None else len(stages)
    if stages:
        problems += schedule.problems(pp, len(stages), microbatches)
    if problems:
        raise PipelineError(problems)
    split = PipelineStages(pp, schedule, microbatches, stages, parts.everywhere)
    return order_checked(split) if check_order else split


def order_checked(split: PipelineStages) -> PipelineStages:
    """``split``, once torch's own checks of its schedule pass (building its order), before
    anything is built; a ``PipelineError`` naming torch's refusal otherwise."""
    try:
        _ = split.order
    except ValueError as error:
        raise PipelineError([str(error)]) from None
    return split


@dataclass(frozen=True)
class _ModelParts:
    inputs: tuple[str, ...]
    blocks: tuple[str, ...]
    outputs: tuple[str, ...]
    everywhere: tuple[str, ...]


def _model_parts(index: ModelIndex) -> _ModelParts:
    """The layer list's blocks, and the modules holding parameters before and after it."""
    list_fqn = index.layer_list()
    if list_fqn is None:
        raise PipelineError(["the model has no layer list (a ModuleList of blocks) to split into stages"])
    length = dict(index.module_lists)[list_fqn]
    prefix = f"{list_fqn}." if list_fqn else ""
    blocks = tuple(f"{prefix}{number}" for number in range(length))
    holding: set[str] = set()  # every module holding a parameter, itself or inside it
    for fqn in index.parameter_fqns:
        holder = fqn.rpartition(".")[0]
        while holder not in holding:
            holding.add(holder)
            if not holder:
                break
            holder = holder.rpartition(".")[0]
    inputs: list[str] = []
    outputs: list[str] = []
    everywhere: list[str] = []
    path = list_fqn
    while path:
        parent = path.rpartition(".")[0]
        siblings = [fqn for fqn in index.module_fqns if fqn and fqn.rpartition(".")[0] == parent]
        position = siblings.index(path)
        for order, sibling in enumerate(siblings):
            if sibling == path:
                continue
            if sibling not in holding:
                everywhere.append(sibling)
            elif order < position:
                inputs.append(sibling)
            else:
                outputs.append(sibling)
        path = parent
    return _ModelParts(tuple(inputs), blocks, tuple(outputs), tuple(everywhere))


def _stage_count(pp: int, schedule: Schedule, pipeline: Pipeline, blocks: int, problems: list[str]) -> int:
    effective = blocks + pipeline.first_stage_less_layers + pipeline.last_stage_less_layers
    if pipeline.layers_per_stage is not None:
        return math.ceil(effective / pipeline.layers_per_stage)
    count = pp * schedule.default_stages_per_rank()
    if count > effective:
        problems.append(
            f"pp={pp} with {schedule.name} makes {count} stages, but the model has {blocks} blocks to split "
            f"(and its first and last stages' modules, counted as {pipeline.first_stage_less_layers} and "
            f"{pipeline.last_stage_less_layers})"
        )
    return count


def _even_split(parts: _ModelParts, count: int, pipeline: Pipeline, problems: list[str]) -> tuple[tuple[str, ...], ...]:
    """torchtitan's split: the blocks and the input and output modules (weighing as
    ``first_stage_less_layers`` and ``last_stage_less_layers`` blocks) spread evenly, the first
    stages taking one more where they do not divide."""
    first, last = pipeline.first_stage_less_layers, pipeline.last_stage_less_layers
    effective = len(parts.blocks) + first + last
    per_stage, extra = divmod(effective, count)
    if count == 1:
        return ((*parts.inputs, *parts.blocks, *parts.outputs),)
    if per_stage == 0 or first > per_stage or last > per_stage:
        problems.append(
            f"{count} stages over {len(parts.blocks)} blocks (with the first stage's modules as {first} and the last's "
            f"as {last}) leave a stage empty: use fewer stages or smaller *_stage_less_layers"
        )
        return ()
    stages: list[tuple[str, ...]] = []
    next_block = 0
    for stage in range(count):
        size = per_stage + (stage < extra)
        size -= first if stage == 0 else last if stage == count - 1 else 0
        taken = parts.blocks[next_block : next_block + size]
        next_block += len(taken)
        stages.append((*parts.inputs, *taken) if stage == 0 else (*taken, *parts.outputs) if stage == count - 1 else taken)
    return tuple(stages)


def _coverage_problems(index: ModelIndex, stages: tuple[tuple[str, ...], ...], everywhere: tuple[str, ...]) -> list[str]:
    """Each stage module must be a module of the model, none in two stages, and each parameter in one."""
    problems = []
    known = set(index.module_fqns)
    roots = [(number, fqn) for number, modules in enumerate(stages) for fqn in modules]
    for number, modules in enumerate(stages):
        problems += [f"stage {number}: {fqn!r} is not a module of the model" for fqn in modules if fqn not in known]
        if not modules:
            problems.append(f"stage {number} holds no module")
    for position, (number, fqn) in enumerate(roots):
        for other, other_fqn in roots[position + 1 :]:
            if other != number and (_within(fqn, other_fqn) or _within(other_fqn, fqn)):
                problems.append(
                    f"{fqn!r} (stage {number}) and {other_fqn!r} (stage {other}) overlap: each module is in one stage"
                )
    held = [fqn for _, fqn in roots] + list(everywhere)
    missing = [fqn for fqn in index.parameter_fqns if not any(_within(fqn, root) for root in held)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        problems.append(f"no stage holds {', '.join(map(repr, missing[:3]))}{more}")
    return problems


def _within(fqn: str, root: str) -> bool:
    """Whether ``fqn`` is ``root`` or inside it (every FQN is inside the root, ``""``)."""
    return not root or fqn == root or fqn.startswith(f"{root}.")


def _ranges(modules: Sequence[str]) -> str:
    """Module FQNs with runs of numbered blocks shortened (``blocks.0-3``)."""
    shown: list[str] = []
    for fqn in modules:
        head, _, number = fqn.rpartition(".")
        if number.isdigit() and shown and shown[-1].startswith(f"{head}."):
            last = shown[-1][len(head) + 1 :]
            start, _, end = last.partition("-")
            if (end or start).isdigit() and int(end or start) + 1 == int(number):
                shown[-1] = f"{head}.{start}-{number}"
                continue
        shown.append(fqn)
    return ", ".join(shown)

"""Pipeline ranks that run alike stages: what each holds is the same classes and parameters (names
within each stage's modules, shapes, dtypes) in the same places, none holds the first or the last
stage (which take the tokens or make the loss), and torch's schedule runs the same actions on each
of its stages, beginning and ending with the same (a "v" schedule splits some backwards on one
rank and not on another). One step of such ranks runs the same actions on the same shapes: a trace of one stands
for the others, its stages renumbered."""

from __future__ import annotations

from collections.abc import Sequence

from meshbind.model_index import ModelIndex
from meshbind.pipeline.stages import PipelineStages


def alike_pipeline_ranks(signatures: Sequence[object], stages: PipelineStages) -> dict[int, int]:
    """Each pipeline rank that runs stages alike an earlier rank's (``signatures``: each stage's, as
    ``stage_signatures`` tells them apart), mapped to the first such rank."""
    order = stages.order
    last = len(stages.stages) - 1
    first_with: dict[tuple[object, ...], int] = {}
    alike = {}
    for rank in range(stages.pp):
        mine = stages.stages_of_rank(rank)
        if 0 in mine or last in mine:
            continue
        actions = [[(kind, microbatch) for step in order[rank] for kind, at, microbatch in step if at == stage] for stage in mine]
        # The same actions on each stage, the same first and last (FSDP gathers in the first, reduces in the last).
        ran = tuple((frozenset(done), done[0], done[-1]) for done in actions)
        signature = (tuple(signatures[stage] for stage in mine), ran)
        if signature in first_with:
            alike[rank] = first_with[signature]
        else:
            first_with[signature] = rank
    return alike


def stage_signatures(index: ModelIndex, stages: PipelineStages) -> list[tuple[object, ...]]:
    """Each stage told apart by what makes stages alike: for each of its modules in order, the
    classes and parameters within it. One pass over the index's modules and one over its parameters."""
    root_of = {root: (stage, place) for stage, roots in enumerate(stages.stages) for place, root in enumerate(roots)}
    found: list[list[list[object]]] = [[[] for _ in roots] for roots in stages.stages]
    for fqn, cls in zip(index.module_fqns, index.module_classes, strict=True):
        if (held := _held(fqn, root_of)) is not None:
            stage, place, within = held
            found[stage][place].append((within, cls))
    for fqn, kind in index.parameters():
        if (held := _held(fqn, root_of)) is not None:
            stage, place, within = held
            found[stage][place].append((within, kind))
    return [tuple(tuple(module) for module in stage) for stage in found]


def _held(fqn: str, root_of: dict[str, tuple[int, int]]) -> tuple[int, int, str] | None:
    """The stage and place of the stage module ``fqn`` lies in, and its name within that module."""
    path = fqn
    while True:
        if path in root_of:
            stage, place = root_of[path]
            return stage, place, fqn[len(path) :]
        if not path:
            return None
        path = path.rpartition(".")[0]

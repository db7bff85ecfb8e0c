"""Pipeline stages told apart by what they hold: the same classes and parameters (names within
each stage's modules, shapes, dtypes) in the same places. Stages alike by this run the same actions
on the same shapes, so an action on one is a twin of an action on another (``pipeline/runtime.py``)."""

from __future__ import annotations

from meshbind.model_index import ModelIndex
from meshbind.pipeline.stages import PipelineStages


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

"""The per-module rules, in order, each on what it depends on alone.

``class_failure`` (rules 1 and 2) depends only on a class and a spec, ``sharding_failure`` (rules
3 and 4) only on a sharding: the batch runs each once per distinct pair or object. Rule 5's
arithmetic runs in Rust over every module at once (``batch.py``); rule 6 is the spec's own
``validate``, run last.
"""

from __future__ import annotations

import inspect

from meshbind.errors import ProblemCode
from meshbind.placements import placements_text
from meshbind.specs import ModuleShardingSpec, ParallelModuleSpec

Failure = tuple[ProblemCode, str]
"""``(code, message)``."""

RAISE_TO_REJECT = "a validate callable raises to reject a module and returns None to accept it"
"""Why a value returned by ``validate`` or ``validate_materialized`` is a failure: read as a
verdict, a returned ``False`` would otherwise pass unseen."""


def bound_signature(cls: type, name: str) -> inspect.Signature:
    """The signature of ``cls.name`` as called on an instance (``self`` already bound)."""
    static = inspect.getattr_static(cls, name)
    signature = inspect.signature(getattr(cls, name))
    if inspect.isfunction(static):
        parameters = list(signature.parameters.values())
        if not parameters or parameters[0].kind not in (parameters[0].POSITIONAL_ONLY, parameters[0].POSITIONAL_OR_KEYWORD):
            raise TypeError("it takes no self argument")
        signature = signature.replace(parameters=parameters[1:])
    return signature


def class_failure(cls: type, spec: ParallelModuleSpec) -> Failure | None:
    """Rule 1 (every stage a callable of the class accepting its keywords) and rule 2
    (``bind_parallel(binding)`` unless the kind is ``none``)."""
    for stage, keywords in spec.stages.items():
        try:
            static = inspect.getattr_static(cls, stage)
        except AttributeError:
            return (
                ProblemCode.STAGE,
                f"stage {stage!r} is not defined on class {cls.__qualname__} (an instance attribute does not count)",
            )
        if not callable(static) and not isinstance(static, (staticmethod, classmethod)):
            return ProblemCode.STAGE, f"stage {stage!r} of class {cls.__qualname__} is not callable"
        try:
            bound_signature(cls, stage).bind_partial(**dict.fromkeys(keywords))
        except (TypeError, ValueError) as error:
            return ProblemCode.STAGE, f"stage {cls.__qualname__}.{stage} does not accept the keywords {list(keywords)}: {error}"
    if spec.binding_kind != "none":
        try:
            static = inspect.getattr_static(cls, "bind_parallel")
        except AttributeError:
            return (
                ProblemCode.BINDING,
                f"binding kind {spec.binding_kind!r} needs {cls.__qualname__}.bind_parallel(binding), which is not defined",
            )
        try:
            if not callable(static):
                raise TypeError("it is not callable")
            bound_signature(cls, "bind_parallel").bind(None)
        except (TypeError, ValueError) as error:
            return (
                ProblemCode.BINDING,
                f"{cls.__qualname__}.bind_parallel must accept one positional argument (the binding): {error}",
            )
    return None


def sharding_failure(sharding: ModuleShardingSpec) -> Failure | None:
    """Rule 3 (no expert stack) and rule 4 (``in_src == in_dst``; ``out_src == out_dst`` when set)."""
    if sharding.expert_stack is not None:
        return (
            ProblemCode.EXPERT,
            f"the sharding still stacks {sharding.expert_stack} per-expert modules; "
            "a stage module owns fused [E, ...] parameters",
        )
    if dict(sharding.in_src) != dict(sharding.in_dst):
        return (
            ProblemCode.STAGE,
            f"in_src {placements_text(sharding.in_src)} differs from in_dst {placements_text(sharding.in_dst)}: "
            "the module must receive its computation layout directly",
        )
    if sharding.out_dst is not None and dict(sharding.out_src) != dict(sharding.out_dst):
        return (
            ProblemCode.STAGE,
            f"out_src {placements_text(sharding.out_src)} differs from out_dst {placements_text(sharding.out_dst)}: "
            "the module must restore its own output layout",
        )
    return None

"""The per-module rules, in order, each on what it depends on alone.

``class_failure`` (rules 1 and 2) depends only on a class and a spec, ``sharding_failure`` (rules
3 and 4) only on a sharding: the batch runs each once per distinct pair or object. Rule 5's
arithmetic runs in Rust over every module at once (``batch.py``); rule 6 is the spec's own
``validate``, run last.
"""

from __future__ import annotations

import inspect
from types import FunctionType

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


class ClassFailures:
    """``class_failure`` once per (class, spec) a caller meets: a plan's modules are mostly alike,
    and both rules inspect signatures. Keyed by the spec's identity, which the caller keeps alive."""

    def __init__(self) -> None:
        self._found: dict[tuple[type, int], Failure | None] = {}

    def __call__(self, cls: type, spec: ParallelModuleSpec) -> Failure | None:
        key = (cls, id(spec))
        if key not in self._found:
            self._found[key] = class_failure(cls, spec)
        return self._found[key]


def class_failure(cls: type, spec: ParallelModuleSpec) -> Failure | None:
    """Rule 1 (every stage a callable of the class accepting its keywords) and rule 2
    (``bind_parallel(binding)`` unless the kind is ``none``)."""
    if surely_passes(cls, spec):
        return None
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


def surely_passes(cls: type, spec: ParallelModuleSpec) -> bool:
    """Rules 1 and 2 read from the code of plain functions: ``True`` only when both surely pass.
    Anything else (a wrapper, a descriptor, a metaclass, a failure) is ``False`` and goes through
    ``inspect``, which words the failure; ``inspect.signature`` costs ~20 µs a call."""
    if type(cls) is not type:
        return False
    stages = all(_plain_accepts(_class_attribute(cls, stage), keywords) for stage, keywords in spec.stages.items())
    return stages and (spec.binding_kind == "none" or _plain_accepts(_class_attribute(cls, "bind_parallel"), None))


def _class_attribute(cls: type, name: str) -> object:
    """What ``inspect.getattr_static(cls, name)`` finds on a class whose metaclass is ``type``;
    ``None`` when no class of its MRO defines it or ``type`` does (inspect then decides)."""
    if name in type.__dict__:
        return None
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _plain_accepts(function: object, keywords: tuple[str, ...] | None) -> bool:
    """Whether a plain function, called as a method, surely accepts ``keywords`` (``bind_partial``)
    or, for ``None``, one positional argument and nothing more (``bind``)."""
    if type(function) is not FunctionType or "__wrapped__" in function.__dict__ or "__signature__" in function.__dict__:
        return False
    code = function.__code__
    if code.co_argcount < 1:  # no self
        return False
    if keywords is not None:
        named = code.co_varnames[max(code.co_posonlyargcount, 1) : code.co_argcount + code.co_kwonlyargcount]
        return bool(code.co_flags & inspect.CO_VARKEYWORDS) or all(keyword in named for keyword in keywords)
    required_positional = code.co_argcount - 1 - len(function.__defaults__ or ())
    kwonly = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    required_kwonly = [name for name in kwonly if name not in (function.__kwdefaults__ or {})]
    takes_one = code.co_argcount >= 2 or bool(code.co_flags & inspect.CO_VARARGS)
    return takes_one and required_positional <= 1 and not required_kwonly


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

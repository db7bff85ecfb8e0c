"""The model index: what one full walk of a module tree found, kept as data.

``resolve_plan(..., index=True)`` (what ``meshbind check`` runs) walks the model once and keeps
this index on the plan (``plan.index``); the FSDP units, the plan report, the ranks' agreement and
step memory read it instead of walking the model again. It holds shapes, dtypes and names, never
a parameter, so a plan kept alive keeps no weight alive; it knows its model by a weak reference
and answers only for that very model (``index_of``). It describes the model as it was walked: a
model changed afterwards (parameters replaced, a dtype cast) needs a new walk.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from meshbind._core import ModuleTree, PatternSet


@dataclass(frozen=True)
class ParameterKind:
    """What parameters alike share: shape, dtype, device type and whether they learn."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True, eq=False)
class ModelIndex:
    """Every module and parameter of one model, in ``named_modules()`` and ``named_parameters()``
    order, as one full walk found them."""

    model: weakref.ref[nn.Module] = field(repr=False)
    names: tuple[str, ...]
    """Every module FQN, aliases of shared modules included, in walk order."""
    name_modules: tuple[int, ...]
    """The module each name denotes (an index into ``module_fqns``)."""
    module_fqns: tuple[str, ...]
    """Each module once, under its first FQN."""
    module_classes: tuple[type, ...]
    parameter_fqns: tuple[str, ...]
    """Each parameter once, under its first FQN (``named_parameters()``)."""
    parameter_kinds: tuple[int, ...]
    """The kind of each parameter, an index into ``kinds``."""
    kinds: tuple[ParameterKind, ...]
    ties: Mapping[str, str]
    """Each later FQN of a parameter (a tie, or a shared module's alias) → its first FQN, in
    ``named_parameters(remove_duplicate=False)`` order."""

    @staticmethod
    def of(model: nn.Module) -> ModelIndex:
        """One full walk of ``model``."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        return ModelIndex.of_tree(model, walk_whole(model))

    @staticmethod
    def of_tree(model: nn.Module, tree: ModuleTree) -> ModelIndex:
        """The index of a full walk of ``model`` that read the parameters (``walk(model,
        prune=False, parameters=True)``, with any patterns)."""
        named = tree.named_parameters()
        kinds = tuple(
            ParameterKind(tuple(sample.shape), sample.dtype, sample.device.type, bool(sample.requires_grad))
            for sample in named.samples
        )
        classes = tree.classes()
        return ModelIndex(
            weakref.ref(model),
            tuple(tree.names()),
            tuple(tree.name_modules()),
            tuple(tree.module_fqns(range(tree.module_count))),
            tuple(classes[c] for c in tree.module_classes()),
            tuple(named.fqns),
            tuple(named.kinds),
            kinds,
            dict(named.ties),
        )

    def is_of(self, model: object) -> bool:
        return self.model() is model

    def restricted(self, model: nn.Module, keep: Callable[[str], bool] | None = None) -> ModelIndex:
        """The index of ``model``, made as the indexed model was (a new build of it, or a copy
        keeping only the modules whose FQN ``keep`` admits), from this one: not walked again.
        Step memory's traced models are such builds and copies."""
        if keep is None:
            return replace(self, model=weakref.ref(model))
        new_module: dict[int, int] = {}
        for module, fqn in enumerate(self.module_fqns):
            if keep(fqn):
                new_module[module] = len(new_module)
        pairs = zip(self.names, self.name_modules, strict=True)
        names = [(name, new_module[m]) for name, m in pairs if m in new_module and keep(name)]
        owned = zip(self.parameter_fqns, self.parameter_kinds, strict=True)
        parameters = [(fqn, kind) for fqn, kind in owned if keep(_holder(fqn))]
        return ModelIndex(
            weakref.ref(model),
            tuple(name for name, _ in names),
            tuple(module for _, module in names),
            tuple(self.module_fqns[m] for m in new_module),
            tuple(self.module_classes[m] for m in new_module),
            tuple(fqn for fqn, _ in parameters),
            tuple(kind for _, kind in parameters),
            self.kinds,
            {later: first for later, first in self.ties.items() if keep(_holder(later)) and keep(_holder(first))},
        )

    def parameters(self) -> list[tuple[str, ParameterKind]]:
        """Each parameter once, with its kind, in ``named_parameters()`` order."""
        kinds = self.kinds
        return [(fqn, kinds[kind]) for fqn, kind in zip(self.parameter_fqns, self.parameter_kinds, strict=True)]

    @functools.cached_property
    def _class_of_name(self) -> dict[str, type]:
        classes, modules = self.module_classes, self.name_modules
        return {name: classes[modules[i]] for i, name in enumerate(self.names)}

    def class_of(self, fqn: str) -> type:
        """The class of the module at ``fqn`` (any of its FQNs); a ``KeyError`` when none is there."""
        return self._class_of_name[fqn]

    @functools.cached_property
    def module_lists(self) -> tuple[tuple[str, int], ...]:
        """``(FQN, length)`` of each non-empty ``ModuleList``, in ``named_modules()`` order."""
        lists = {fqn: 0 for fqn, cls in zip(self.module_fqns, self.module_classes, strict=True) if issubclass(cls, nn.ModuleList)}
        if not lists:
            return ()
        for name in self.names:
            parent = name.rpartition(".")[0]
            if name and parent in lists:
                lists[parent] += 1
        return tuple((fqn, length) for fqn, length in lists.items() if length)

    def layer_list(self) -> str | None:
        """The FQN of the model's blocks: its longest non-empty ``ModuleList`` (torchtitan's
        ``model.layers``; the first of the longest), ``None`` when it has none. FSDP's default
        units and activation checkpointing both wrap its members."""
        lists = self.module_lists
        return max(lists, key=lambda item: item[1])[0] if lists else None


def walk_whole(model: nn.Module) -> ModuleTree:
    """The one full walk of ``model``, parameters read and nothing matched: an index is made of it,
    and a plan's patterns are matched over it again (``PatternSet.match_tree``) without walking."""
    return PatternSet([]).walk(model, prune=False, parameters=True)


def _holder(parameter_fqn: str) -> str:
    """The FQN of the module holding a parameter."""
    return parameter_fqn.rpartition(".")[0]


def index_of(model: nn.Module, known: ModelIndex | None) -> ModelIndex:
    """``known`` when it is ``model``'s own index, else a new walk of ``model``."""
    return known if known is not None and known.is_of(model) else ModelIndex.of(model)

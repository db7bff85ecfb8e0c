"""transformers' parallel styles read as placements: each group's rules, the placement a style
gives a parameter, and the layout provider that checks a group against the config's facts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from transformers.distributed.expert_parallel import MoEParamShard
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.distributed.tensor_parallel import (
    ColwiseParallel,
    EmbeddingParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    RowwiseParallel,
)

from meshbind.errors import LayoutRefusal
from meshbind.interop.hf_facts import ATTENTION_PROJECTIONS, ConfigFacts, head_refusals, size_refusals
from meshbind.placements import shard_dim
from meshbind.specs import LayoutContext, ModuleShardingSpec

PLANS = ("tp", "ep")
"""transformers' plans meshbind resolves, each on the axis of its name."""


@dataclass
class Rules:
    """One group's styles in one plan: the module's own, and each parameter's that has its own key."""

    module: str | None = None
    params: dict[str, str] = field(default_factory=dict)

    def style_of(self, parameter: str) -> str | None:
        return self.params.get(parameter, self.module)


@dataclass(frozen=True)
class GroupLayout:
    """The layout provider of one group: each own parameter's placement per plan, from transformers'
    style objects, refused with the config fact an axis does not divide."""

    name: str
    group: Mapping[str, Rules]
    facts: ConfigFacts
    output_embeddings: nn.Module | None

    layouts: dict[tuple[Any, ...], ModuleShardingSpec | str] = field(default_factory=dict, compare=False)
    """Each answer by the shapes, facts and role it depends on: the layers of a group share one
    layout object, which validation then checks once."""

    def __call__(self, module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        assert module is not None  # from_hf_plan reads a module tree, never FQNs
        shapes = tuple((name, value.shape) for name, value in module._parameters.items() if value is not None)
        embedding = isinstance(module, nn.Embedding) or module is self.output_embeddings
        facts = self.facts.at(self._layer_of(fqn))
        key = (context, shapes, embedding, id(facts))
        answer = self.layouts.get(key)
        if answer is None:
            answer = self.layouts[key] = self._layout(shapes, context, facts, embedding)
        if isinstance(answer, str):
            raise LayoutRefusal(answer)
        return answer

    def _layer_of(self, fqn: str) -> int | None:
        """The layer index of ``fqn``: where the group's key has its first ``*``."""
        parts = self.name.split(".")
        if "*" not in parts[1:]:
            return None
        return int(fqn.split(".")[parts.index("*", 1)])

    def _layout(
        self, shapes: tuple[tuple[str, Any], ...], context: LayoutContext, facts: ConfigFacts, embedding: bool
    ) -> ModuleShardingSpec | str:
        """The layout of a module whose own parameters have ``shapes``, or why it is refused."""
        params: dict[str, dict[str, Placement]] = {}
        refusals: list[str] = []
        for parameter, shape in shapes:
            for kind, rules in self.group.items():
                style = rules.style_of(parameter)
                if style is None:
                    continue
                placement = style_placement(ALL_PARALLEL_STYLES[style], parameter, len(shape))
                params.setdefault(parameter, {})[kind] = placement
                refusals += size_refusals(self.name, facts, embedding, parameter, shape, placement, kind, context.size(kind))
        projection = self.name.rpartition(".")[2]
        if projection in ATTENTION_PROJECTIONS and self._splits_heads(params):
            # Their sharded sizes are heads times head size: the heads are the fact that must divide.
            refusals = head_refusals(projection, facts, context)
        if refusals:
            return "; ".join(dict.fromkeys(refusals))
        return ModuleShardingSpec(params=params)

    def _splits_heads(self, params: Mapping[str, Mapping[str, Placement]]) -> bool:
        """Whether the module's tp style leaves each rank some of the heads: a column split whose output
        stays sharded, or a row split whose input arrives sharded. A gathered output
        (``colwise_gather_output``) keeps every head whole, as transformers' ``get_kv_heads_per_rank`` counts."""
        if not any(shard_dim(placed.get("tp")) is not None for placed in params.values()):
            return False
        rules = self.group["tp"]
        styles = [rules.module] if rules.module is not None else list(rules.params.values())
        return any(style_splits_heads(ALL_PARALLEL_STYLES[style]) for style in styles)


def style_splits_heads(style: object) -> bool:
    if isinstance(style, (PackedColwiseParallel, PackedRowwiseParallel)):
        return True
    if isinstance(style, ColwiseParallel):
        return isinstance(style.output_layouts, Shard)
    if isinstance(style, RowwiseParallel):
        return isinstance(style.input_layouts, Shard)
    return False


def style_placement(style: object, parameter: str, ndim: int) -> Placement:
    """The placement transformers' ``style`` object gives a parameter of rank ``ndim`` on its axis
    (what its ``shard_param`` passes ``distribute_tensor``); styles that shard nothing replicate."""
    if isinstance(style, PackedColwiseParallel):
        return Shard(0) if ndim == 1 else _StridedShard(dim=ndim - 2, split_factor=style.split_factor)
    if isinstance(style, PackedRowwiseParallel):
        return Replicate() if ndim == 1 else _StridedShard(dim=ndim - 1, split_factor=style.split_factor)
    if isinstance(style, ColwiseParallel):
        return Shard(max(ndim - 2, 0))
    if isinstance(style, RowwiseParallel):
        return Replicate() if parameter == "bias" else Shard(ndim - 1)
    if isinstance(style, EmbeddingParallel):
        return Shard(style.shard_dim)
    if isinstance(style, MoEParamShard):
        placement: Placement = style.placement
        return placement
    return Replicate()

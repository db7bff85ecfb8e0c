"""What a transformers config says about the sizes a plan shards, and the refusals it explains:
a dimension an axis does not divide, named after the config field it is (heads, vocabulary, an
inner size, the experts)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor import Placement
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import PreTrainedModel

from meshbind._core import not_divisible
from meshbind.placements import split_dim
from meshbind.specs import LayoutContext

ATTENTION_PROJECTIONS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "q_b_proj", "kv_b_proj"}
)
"""Projections whose sharded dimension is attention heads: ``num_attention_heads`` must divide."""
KEY_VALUE_PROJECTIONS = frozenset({"k_proj", "v_proj", "qkv_proj", "query_key_value"})
"""Projections whose sharded dimension is key/value heads: ``num_key_value_heads`` must divide."""

EMBEDDING_FACTS = ("vocab_size", "hidden_size")
"""What each dimension of an embedding or output-embedding weight is (``[vocab, hidden]``)."""
INNER_FACTS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "hidden_size")
"""The sizes another projection's sharded dimension may be: a dense MLP's first, in this order."""
EXPERT_INNER_FACTS = ("moe_intermediate_size", "intermediate_size", "hidden_size")
SHARED_EXPERT_INNER_FACTS = ("shared_expert_intermediate_size", "moe_intermediate_size", "intermediate_size", "hidden_size")
SIZE_FACTS = tuple(dict.fromkeys(EMBEDDING_FACTS + INNER_FACTS))
"""Every config size a sharded dimension is named after."""
EXPERT_FACTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""What configs call the number of routed experts."""
CHECKED_FACTS = ("num_attention_heads", "num_key_value_heads", *EXPERT_FACTS, *SIZE_FACTS)
"""Every config field the checks read."""
PAD_VOCABULARY = "pad the vocabulary in the model's config to a multiple of it (Megatron's make-vocab-size-divisible-by)"


def defaulted_facts(config: Any, given: Collection[str]) -> dict[str, int]:
    """The checked fields ``config`` holds that a config file setting only ``given`` left to the
    config class's default (or to the value derived from another field): a check then cites a value
    the file never held, and the command line says so."""
    aliases = getattr(config, "attribute_map", {})
    named = set(given) | {aliases[key] for key in given if key in aliases}
    defaulted = {}
    for name in CHECKED_FACTS:
        try:
            value = getattr(config, name, None)
        except Exception:  # a field that differs between layers has no one value
            continue
        if name not in named and isinstance(value, int) and not isinstance(value, bool):
            defaulted[name] = value
    return defaulted


@dataclass(frozen=True, eq=False)
class ConfigFacts:
    """What the text config says about the sizes a plan shards; a config whose layers differ (its
    ``per_layer_config``) gives each such layer facts of its own."""

    attention_heads: int | None
    key_value_heads: int | None
    experts: tuple[str, int] | None
    sizes: Mapping[str, int]
    layers: Mapping[int, ConfigFacts] = field(default_factory=dict)

    @staticmethod
    def of(model: PreTrainedModel) -> ConfigFacts:
        config = model.config.get_text_config()
        varying = frozenset(getattr(config, "per_layer_attributes", None) or ())
        facts = ConfigFacts.read(config, varying)
        if not varying.intersection(CHECKED_FACTS):
            return facts
        layers = {index: ConfigFacts.read(layer, frozenset()) for index, layer in enumerate(config.per_layer_config)}
        return dataclasses.replace(facts, layers=layers)

    @staticmethod
    def read(config: Any, varying: frozenset[str]) -> ConfigFacts:
        """The facts of ``config`` but those in ``varying``, which differ between layers."""
        aliases = getattr(config, "attribute_map", {})  # name the field the config itself holds

        def fact(name: str) -> int | None:
            value = None if name in aliases or name in varying else getattr(config, name, None)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        heads = fact("num_attention_heads")
        experts = next(((name, value) for name in EXPERT_FACTS if (value := fact(name)) is not None), None)
        sizes = {name: value for name in SIZE_FACTS if (value := fact(name)) is not None}
        return ConfigFacts(heads, fact("num_key_value_heads") or heads, experts, sizes)

    def at(self, layer: int | None) -> ConfigFacts:
        """The facts of layer ``layer`` (``None``: a module in no layer)."""
        return self.layers.get(layer, self) if layer is not None else self


def head_refusals(projection: str, facts: ConfigFacts, context: LayoutContext) -> list[str]:
    tp = context.size("tp")
    checked = [("num_attention_heads", facts.attention_heads)]
    if projection in KEY_VALUE_PROJECTIONS:
        checked.append(("num_key_value_heads", facts.key_value_heads))
    return [problem for name, heads in checked if heads and (problem := not_divisible(name, heads, "tp", tp)) is not None]


def size_refusals(
    group: str,
    facts: ConfigFacts,
    embedding: bool,
    parameter: str,
    shape: Sequence[int],
    placement: Placement,
    kind: str,
    size: int,
) -> list[str]:
    """Why ``size`` does not split the dimension ``placement`` shards, named after the config field
    that dimension is by the parameter's role: an embedding's vocabulary or hidden size, an expert
    count, or the inner size of the projection's kind of MLP."""
    dim = split_dim(placement, len(shape))
    if dim is None:
        return []  # a dimension beyond the rank is resolution's own layout problem
    split = placement.split_factor if isinstance(placement, _StridedShard) else 1
    extent = shape[dim] // split
    if extent * split == shape[dim] and extent % size == 0:
        return []
    if kind == "ep" and facts.experts and extent == facts.experts[1]:
        name, experts = facts.experts
        return [problem] if (problem := not_divisible(name, experts, "ep", size)) is not None else []
    if embedding:
        names: tuple[str, ...] = (EMBEDDING_FACTS[dim],) if dim < len(EMBEDDING_FACTS) else ()
    elif "shared_expert" in group:
        names = SHARED_EXPERT_INNER_FACTS
    elif "expert" in group:
        names = EXPERT_INNER_FACTS
    else:
        names = INNER_FACTS
    for name in names:
        if facts.sizes.get(name) == extent:
            hint = f": {PAD_VOCABULARY}" if name == "vocab_size" else ""
            problem = not_divisible(name, int(extent), kind, size)
            return [] if problem is None else [problem + hint]
    if split > 1:
        return [
            f"{parameter} packs {split} projections along dimension {dim} (size {shape[dim]}): "
            f"each, of size {shape[dim] / split:g}, must be divisible by the {kind!r} axis size {size}"
        ]
    return []  # resolution's uneven-shard check names the parameter and dimension

"""Hugging Face transformers plans: a model's own ``tp_plan`` / ``ep_plan``, resolved by
meshbind the way transformers resolves them and applied by transformers' own code.

transformers writes a layer index as ``*`` (``model.layers.*.mlp.experts``) and looks every module
and parameter name up exactly, with its indices replaced: a key selects the modules and parameters
whose name is the key once their indices are ``*``. A module key gives its style to the module and
to each of its own parameters that has no key of its own. ``from_hf_plan`` matches every key in one
walk, groups the rules by the module they land on (the experts module of Qwen3-MoE gets its own
style and those of its ``gate_up_proj`` and ``down_proj``), and gives ``resolve_plan`` one request
per group, whose layout provider checks the config's facts (heads, sizes, vocabulary, experts)
against the axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import PreTrainedModel
from transformers.distributed.expert_parallel import MoEParamShard, apply_expert_parallelism
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
from transformers.distributed.tensor_parallel import (
    ColwiseParallel,
    EmbeddingParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    RowwiseParallel,
    apply_tensor_parallelism,
)

from meshbind._core import PatternSet
from meshbind.agreement import check_ranks_agree, mesh_entries, model_entries, plan_entries
from meshbind.errors import LayoutRefusal, PlanProblem, ProblemCode
from meshbind.interop import HF_PROTOCOL
from meshbind.placements import shard_dim, split_dim
from meshbind.resolution.plan import ParallelPlan
from meshbind.specs import (
    LayoutContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    SourcedRequests,
    literal_pattern,
)

PROTOCOL = HF_PROTOCOL
"""The protocol of every spec ``from_hf_plan`` makes; ``options["rules"]`` holds the styles."""

PLANS = ("tp", "ep")
"""transformers' plans meshbind resolves, each on the axis of its name."""

ANY_INDEX = "<0-999999999999999999>"
"""What a ``*`` segment of a transformers key matches: a layer index (never digits inside a name)."""

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


def from_hf_plan(model: nn.Module, *, strict: bool = False) -> HFPlan:
    """The plan source ``resolve_plan`` takes for a transformers model's own ``tp_plan`` and
    ``ep_plan``. A key that selects nothing is a warning, as in transformers, or under ``strict`` an
    ``unmatched`` problem; a style string transformers does not know is a ``ValueError`` here."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"from_hf_plan reads a transformers PreTrainedModel's own plans, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    plans = {kind: dict(getattr(model, f"{kind}_plan") or {}) for kind in PLANS}
    unknown = [
        f"{kind}_plan[{key!r}]: {style!r}"
        for kind, plan in plans.items()
        for key, style in plan.items()
        if style not in ALL_PARALLEL_STYLES
    ]
    if unknown:
        raise ValueError(
            f"{type(model).__name__}: styles transformers does not know: {'; '.join(unknown)} "
            f"(known: {', '.join(sorted(ALL_PARALLEL_STYLES))})"
        )
    return HFPlan(model, plans, strict)


def hf_key_pattern(key: str) -> str:
    """The meshbind pattern selecting what transformers' key selects: a whole ``*`` segment after the
    first is a layer index, every other character literal."""
    return ".".join(ANY_INDEX if part == "*" and index else literal_pattern(part) for index, part in enumerate(key.split(".")))


@dataclass
class _Rules:
    """One group's styles in one plan: the module's own, and each parameter's that has its own key."""

    module: str | None = None
    params: dict[str, str] = field(default_factory=dict)

    def style_of(self, parameter: str) -> str | None:
        return self.params.get(parameter, self.module)


class HFPlan:
    """A transformers model's plans, expanded for a context's axes (``from_hf_plan``)."""

    def __init__(self, model: PreTrainedModel, plans: Mapping[str, Mapping[str, str]], strict: bool) -> None:
        self.model, self.plans, self.strict = model, plans, strict

    def active_plans(self, context: LayoutContext) -> dict[str, dict[str, str]]:
        """The rules in effect, as transformers' ``_resolve_parallel_plans`` keeps them: a plan only
        on an axis of size above 1; at ``ep > 1`` no TP rule on an expert module or below it."""
        active = {kind: dict(plan) if context.axis_sizes.get(kind, 1) > 1 else {} for kind, plan in self.plans.items()}
        experts = tuple(active["ep"])
        active["tp"] = {
            key: style for key, style in active["tp"].items() if not any(key == e or key.startswith(e + ".") for e in experts)
        }
        return active

    def requests_for(self, model: nn.Module | Sequence[str], context: LayoutContext) -> SourcedRequests:
        if model is not self.model:
            raise ValueError("resolve_plan was given another model than the one from_hf_plan read the plans of")
        active = self.active_plans(context)
        missing = [
            PlanProblem(ProblemCode.LAYOUT, None, f"{kind}_plan", f"the {kind!r} axis has size {context.axis_sizes[kind]}, "
                        f"but {type(model).__name__} has no {kind}_plan", about="axes")
            for kind in PLANS if context.axis_sizes.get(kind, 1) > 1 and not self.plans[kind]
        ]  # fmt: skip
        # transformers looks names up with their layer indices as '*': a key with an index selects nothing.
        rules = [(kind, key, style) for kind in PLANS for key, style in active[kind].items()]
        lookups = [rule for rule in rules if replace_layer_number_by_wildcard(rule[1]) == rule[1]]
        tree = PatternSet([hf_key_pattern(key) for _, key, _ in lookups]).walk(model, prune=True, parameters=True)
        groups: dict[str, dict[str, _Rules]] = {}
        found: set[tuple[str, str, str]] = set()
        for rule, modules, parameters in zip(lookups, tree.hit_counts(), tree.parameter_hit_counts(), strict=True):
            kind, key, style = rule
            if modules:  # the key names modules: their own style
                groups.setdefault(key, {plan: _Rules() for plan in PLANS})[kind].module = style
            if parameters:  # the key names parameters: their module's group holds their style
                owner, _, parameter = key.rpartition(".")
                groups.setdefault(owner, {plan: _Rules() for plan in PLANS})[kind].params[parameter] = style
            if modules or parameters:
                found.add(rule)
        facts = _ConfigFacts.of(self.model)
        output_embeddings = _output_embeddings(self.model)
        requests = [
            NativeParallelBindingRequest(
                (hf_key_pattern(name),),
                ParallelModuleSpec(PROTOCOL, options={"key": name, "rules": group}, version=transformers.__version__),
                _GroupLayout(name, group, facts, output_embeddings),
            )
            for name, group in groups.items()
        ]
        problems = [*missing, *_tie_problems(self.model, groups)]
        unmatched = self._unmatched([rule for rule in rules if rule not in found])
        if self.strict:
            return SourcedRequests(requests, [*problems, *unmatched])
        return SourcedRequests(requests, problems, unmatched)

    def _unmatched(self, rules: Sequence[tuple[str, str, str]]) -> list[PlanProblem]:
        keys: _PlanKeys | None = None
        problems = []
        for kind, key, style in rules:
            generic = replace_layer_number_by_wildcard(key)
            if generic != key:
                hint = f"; transformers writes layer indices as '*': {generic!r}"
            else:
                keys = keys or _PlanKeys.of(self.model)
                nearest = keys.nearest(key)
                hint = f"; did you mean {', '.join(map(repr, nearest))}?" if nearest else ""
            message = f"key {key!r} ({style}) selects no module or parameter{hint}"
            problems.append(PlanProblem(ProblemCode.UNMATCHED, None, f"{kind}_plan[{key!r}]", message, about="key"))
        return problems


class _PlanKeys:
    """The keys a transformers plan could hold for this model: every module and parameter name with
    its layer indices written ``*``, as transformers looks them up ("did you mean" in the plan's form)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = keys
        self.index = PatternSet([]).index_names(keys, prune=False)

    @staticmethod
    def of(model: nn.Module) -> _PlanKeys:
        tree = PatternSet([]).walk(model, prune=False, parameters=True)
        names = [*tree.names(), *tree.parameter_names()]
        return _PlanKeys(list(dict.fromkeys(map(replace_layer_number_by_wildcard, names))))

    def nearest(self, key: str) -> list[str]:
        """Up to three keys nearest to ``key``, those naming the same leaf first: a rule for
        ``mlp.gate_proj`` is likelier meant for ``mlp.shared_expert.gate_proj`` than the router ``mlp.gate``."""
        pattern = ".".join(part if part == "*" else literal_pattern(part) for part in key.split("."))
        leaf = key.rpartition(".")[2]
        alike = [name for name in self.keys if name.rpartition(".")[2] == leaf]
        first = PatternSet([]).index_names(alike, prune=False).nearest(pattern, 3) if alike else []
        rest = [name for name in self.index.nearest(pattern, 3) if name not in first]
        return [*first, *rest][:3]


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


def _output_embeddings(model: PreTrainedModel) -> nn.Module | None:
    """The model's output embeddings (``lm_head``), whose weight is ``[vocab, hidden]`` like an embedding's."""
    try:
        found = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Every FQN of a parameter that ``named_parameters()`` also yields under an earlier FQN (a tie:
    ``lm_head.weight`` holding ``model.embed_tokens.weight``), mapped to that earlier FQN."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(parameter), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def _tie_problems(model: PreTrainedModel, groups: Mapping[str, Mapping[str, _Rules]]) -> list[PlanProblem]:
    """transformers ties weights again after sharding (the target takes the source's parameter), so
    the two FQNs of a tie must have one layout: a tie whose sides the plan places differently is a
    ``layout`` problem of the target's module."""
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    problems = []
    for target, source in ties.items():
        try:
            parameter = model.get_parameter(target)
        except AttributeError:
            continue  # a buffer, or a tie transformers itself does not make
        if not _owned_parameter_is(model, source, parameter):
            continue
        placed = {fqn: _placed_by_rules(groups, fqn, parameter.ndim) for fqn in (target, source)}
        differing = [kind for kind in PLANS if placed[target].get(kind) != placed[source].get(kind)]
        if not differing:
            continue
        texts = {fqn: ", ".join(f"{kind}:{p}" for kind, p in placed[fqn].items()) or "whole" for fqn in placed}
        message = (
            f"{target!r} is the parameter {source!r} (tied), given two layouts: {texts[target]} against {texts[source]}; "
            "transformers ties them again after sharding, so both must be placed alike"
        )
        module = target.rpartition(".")[0]
        problems.append(PlanProblem(ProblemCode.LAYOUT, module, f"{differing[0]}_plan", message))
    return problems


def _owned_parameter_is(model: nn.Module, fqn: str, parameter: nn.Parameter) -> bool:
    try:
        return model.get_parameter(fqn) is parameter
    except AttributeError:
        return False


def _placed_by_rules(groups: Mapping[str, Mapping[str, _Rules]], fqn: str, ndim: int) -> dict[str, Placement]:
    """The placement per plan that the rules give the parameter ``fqn`` (none: whole)."""
    module, _, parameter = fqn.rpartition(".")
    group = groups.get(replace_layer_number_by_wildcard(module), {})
    placed = {}
    for kind, rules in group.items():
        style = rules.style_of(parameter)
        if style is not None:
            placed[kind] = style_placement(ALL_PARALLEL_STYLES[style], parameter, ndim)
    return placed


@dataclass(frozen=True, eq=False)
class _ConfigFacts:
    """What the text config says about the sizes a plan shards; a config whose layers differ (its
    ``per_layer_config``) gives each such layer facts of its own."""

    attention_heads: int | None
    key_value_heads: int | None
    experts: tuple[str, int] | None
    sizes: Mapping[str, int]
    layers: Mapping[int, _ConfigFacts] = field(default_factory=dict)

    @staticmethod
    def of(model: PreTrainedModel) -> _ConfigFacts:
        config = model.config.get_text_config()
        varying = frozenset(getattr(config, "per_layer_attributes", None) or ())
        facts = _ConfigFacts.read(config, varying)
        if not varying.intersection(CHECKED_FACTS):
            return facts
        layers = {index: _ConfigFacts.read(layer, frozenset()) for index, layer in enumerate(config.per_layer_config)}
        return dataclasses.replace(facts, layers=layers)

    @staticmethod
    def read(config: Any, varying: frozenset[str]) -> _ConfigFacts:
        """The facts of ``config`` but those in ``varying``, which differ between layers."""
        aliases = getattr(config, "attribute_map", {})  # name the field the config itself holds

        def fact(name: str) -> int | None:
            value = None if name in aliases or name in varying else getattr(config, name, None)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        heads = fact("num_attention_heads")
        experts = next(((name, value) for name in EXPERT_FACTS if (value := fact(name)) is not None), None)
        sizes = {name: value for name in SIZE_FACTS if (value := fact(name)) is not None}
        return _ConfigFacts(heads, fact("num_key_value_heads") or heads, experts, sizes)

    def at(self, layer: int | None) -> _ConfigFacts:
        """The facts of layer ``layer`` (``None``: a module in no layer)."""
        return self.layers.get(layer, self) if layer is not None else self


@dataclass(frozen=True)
class _GroupLayout:
    """The layout provider of one group: each own parameter's placement per plan, from transformers'
    style objects, refused with the config fact an axis does not divide."""

    name: str
    group: Mapping[str, _Rules]
    facts: _ConfigFacts
    output_embeddings: nn.Module | None

    layouts: dict[tuple[Any, ...], ModuleShardingSpec | str] = field(default_factory=dict, compare=False)
    """Each answer by the shapes, facts and role it depends on: the layers of a group share one
    layout object, which validation then checks once."""

    def __call__(self, module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        assert module is not None  # requests_for walks a module tree
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
        self, shapes: tuple[tuple[str, Any], ...], context: LayoutContext, facts: _ConfigFacts, embedding: bool
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
                refusals += _size_refusals(self.name, facts, embedding, parameter, shape, placement, kind, context.size(kind))
        projection = self.name.rpartition(".")[2]
        if projection in ATTENTION_PROJECTIONS and self._splits_heads(params):
            # Their sharded sizes are heads times head size: the heads are the fact that must divide.
            refusals = _head_refusals(projection, facts, context)
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
        return any(_style_splits_heads(ALL_PARALLEL_STYLES[style]) for style in styles)


def _style_splits_heads(style: object) -> bool:
    if isinstance(style, (PackedColwiseParallel, PackedRowwiseParallel)):
        return True
    if isinstance(style, ColwiseParallel):
        return isinstance(style.output_layouts, Shard)
    if isinstance(style, RowwiseParallel):
        return isinstance(style.input_layouts, Shard)
    return False


def _head_refusals(projection: str, facts: _ConfigFacts, context: LayoutContext) -> list[str]:
    tp = context.size("tp")
    checked = [("num_attention_heads", facts.attention_heads)]
    if projection in KEY_VALUE_PROJECTIONS:
        checked.append(("num_key_value_heads", facts.key_value_heads))
    return [f"{name} {heads} is not divisible by the 'tp' axis size {tp}" for name, heads in checked if heads and heads % tp]


def _size_refusals(
    group: str,
    facts: _ConfigFacts,
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
        return [f"{name} {experts} is not divisible by the 'ep' axis size {size}"]
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
            return [f"{name} {extent} is not divisible by the {kind!r} axis size {size}{hint}"]
    if split > 1:
        return [
            f"{parameter} packs {split} projections along dimension {dim} (size {shape[dim]}): "
            f"each, of size {shape[dim] / split:g}, must be divisible by the {kind!r} axis size {size}"
        ]
    return []  # resolution's uneven-shard check names the parameter and dimension


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


def expanded_plans(model: nn.Module, plan: ParallelPlan) -> dict[str, dict[str, str]]:
    """The exact plans transformers applies (``_resolve_parallel_plans``' form): every planned
    module's own parameters, then the module, in tree order, per plan."""
    exact: dict[str, dict[str, str]] = {kind: {} for kind in PLANS}
    for fqn, spec in plan.parallel_modules.items():
        if spec.protocol != PROTOCOL:
            continue
        module = model.get_submodule(fqn)
        for kind, rules in spec.options["rules"].items():
            for parameter, value in module._parameters.items():
                if value is not None and (style := rules.style_of(parameter)) is not None:
                    exact[kind][f"{fqn}.{parameter}"] = style
            if rules.module is not None:
                exact[kind][fqn] = rules.module
    return exact


def apply_hf_plan(
    model: nn.Module,
    plan: ParallelPlan,
    *,
    tp_mesh: DeviceMesh | None = None,
    ep_mesh: DeviceMesh | None = None,
    ep_implementation: str = "auto",
) -> nn.Module:
    """Apply a resolved Hugging Face plan with transformers' own ``apply_tensor_parallelism`` and
    ``apply_expert_parallelism``, given the exact plans (no second matching). EP runs, as in
    transformers, when the EP plan dispatches tokens (``ep_dispatch_experts``); it needs the ``tp``
    mesh too (size 1 without TP): the ranks that share a batch.

    A tied parameter (``lm_head.weight`` holding the embedding's) is sharded under its first FQN
    only, then tied again, as transformers' own loading does: one tensor, placed alike on both
    sides (resolution refuses a tie whose sides the plan places differently)."""
    check_ranks_agree("apply_hf_plan", lambda: [*model_entries(model), *plan_entries(plan), *mesh_entries(tp_mesh, ep_mesh)])
    ties = tied_parameters(model)
    exact = {
        kind: {name: style for name, style in rules.items() if name not in ties}
        for kind, rules in expanded_plans(model, plan).items()
    }
    if exact["tp"]:
        if tp_mesh is None:
            raise ValueError("the plan has tensor-parallel rules: pass tp_mesh")
        model = apply_tensor_parallelism(model, tp_mesh, exact["tp"])
    if "ep_dispatch_experts" in exact["ep"].values():
        if ep_mesh is None or tp_mesh is None:
            raise ValueError("the plan has expert-parallel rules: pass ep_mesh and tp_mesh (size 1 without TP)")
        model = apply_expert_parallelism(model, ep_mesh, tp_mesh, exact["ep"], ep_implementation=ep_implementation)
    for alias, canonical in ties.items():
        owner, _, name = alias.rpartition(".")
        setattr(model.get_submodule(owner), name, model.get_parameter(canonical))
    result: nn.Module = model
    return result

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

from collections.abc import Mapping, Sequence

import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
from transformers.distributed.tensor_parallel import (
    apply_tensor_parallelism,
)

from meshbind._core import ModuleTree, PatternSet
from meshbind.agreement import check_ranks_agree, mesh_entries, model_entries, plan_entries
from meshbind.errors import PlanProblem, ProblemCode, did_you_mean
from meshbind.interop import HF_PROTOCOL
from meshbind.interop.hf_facts import ConfigFacts
from meshbind.interop.hf_styles import PLANS, GroupLayout, Rules
from meshbind.interop.hf_ties import tie_problems
from meshbind.model_index import index_of
from meshbind.resolution.plan import ParallelPlan
from meshbind.specs import (
    LayoutContext,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    SourcedRequests,
    literal_pattern,
)

PROTOCOL = HF_PROTOCOL
"""The protocol of every spec ``from_hf_plan`` makes; ``options["rules"]`` holds the styles."""

ANY_INDEX = "<0-999999999999999999>"
"""What a ``*`` segment of a transformers key matches: a layer index (never digits inside a name)."""


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

    def requests_for(self, model: ModuleTree | Sequence[str], context: LayoutContext) -> SourcedRequests:
        if not isinstance(model, ModuleTree) or model.modules([0])[0] is not self.model:
            raise ValueError("resolve_plan was given another model than the one from_hf_plan read the plans of")
        active = self.active_plans(context)
        missing = [
            PlanProblem(ProblemCode.LAYOUT, None, f"{kind}_plan", f"the {kind!r} axis has size {context.axis_sizes[kind]}, "
                        f"but {type(self.model).__name__} has no {kind}_plan", about="axes")
            for kind in PLANS if context.axis_sizes.get(kind, 1) > 1 and not self.plans[kind]
        ]  # fmt: skip
        # transformers looks names up with their layer indices as '*': a key with an index selects nothing.
        rules = [(kind, key, style) for kind in PLANS for key, style in active[kind].items()]
        lookups = [rule for rule in rules if replace_layer_number_by_wildcard(rule[1]) == rule[1]]
        tree = PatternSet([hf_key_pattern(key) for _, key, _ in lookups]).match_tree(model)
        groups: dict[str, dict[str, Rules]] = {}
        found: set[tuple[str, str, str]] = set()
        for rule, modules, parameters in zip(lookups, tree.hit_counts(), tree.parameter_hit_counts(), strict=True):
            kind, key, style = rule
            if modules:  # the key names modules: their own style
                groups.setdefault(key, {plan: Rules() for plan in PLANS})[kind].module = style
            if parameters:  # the key names parameters: their module's group holds their style
                owner, _, parameter = key.rpartition(".")
                groups.setdefault(owner, {plan: Rules() for plan in PLANS})[kind].params[parameter] = style
            if modules or parameters:
                found.add(rule)
        facts = ConfigFacts.of(self.model)
        output_embeddings = _output_embeddings(self.model)
        requests = [
            NativeParallelBindingRequest(
                (hf_key_pattern(name),),
                ParallelModuleSpec(PROTOCOL, options={"key": name, "rules": group}, version=transformers.__version__),
                GroupLayout(name, group, facts, output_embeddings),
            )
            for name, group in groups.items()
        ]
        problems = [*missing, *tie_problems(self.model, groups)]
        unmatched = self._unmatched([rule for rule in rules if rule not in found], model)
        if self.strict:
            return SourcedRequests(requests, [*problems, *unmatched])
        return SourcedRequests(requests, problems, unmatched)

    def _unmatched(self, rules: Sequence[tuple[str, str, str]], whole: ModuleTree) -> list[PlanProblem]:
        keys: _PlanKeys | None = None
        problems = []
        for kind, key, style in rules:
            generic = replace_layer_number_by_wildcard(key)
            if generic != key:
                hint = f"; transformers writes layer indices as '*': {generic!r}"
            else:
                keys = keys or _PlanKeys.of(whole)
                nearest = keys.nearest(key)
                hint = did_you_mean([repr(name) for name in nearest])
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
    def of(whole: ModuleTree) -> _PlanKeys:
        names = [*whole.names(), *whole.parameter_names()]
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


def _output_embeddings(model: PreTrainedModel) -> nn.Module | None:
    """The model's output embeddings (``lm_head``), whose weight is ``[vocab, hidden]`` like an embedding's."""
    try:
        found = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None


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
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Apply a resolved Hugging Face plan with transformers' own ``apply_tensor_parallelism`` and
    ``apply_expert_parallelism``, given the exact plans (no second matching). EP runs, as in
    transformers, when the EP plan dispatches tokens (``ep_dispatch_experts``); it needs the ``tp``
    mesh too (size 1 without TP): the ranks that share a batch.

    A tied parameter (``lm_head.weight`` holding the embedding's) is sharded under its first FQN
    only, then tied again, as transformers' own loading does: one tensor, placed alike on both
    sides (resolution refuses a tie whose sides the plan places differently).

    The ranks of ``group`` agree on the model, plan and meshes first: every rank by default, a
    pipeline stage's (``MeshContext.stage_group``) when the model is one stage."""
    check_ranks_agree(
        "apply_hf_plan",
        lambda: [*model_entries(model, plan.index), *plan_entries(plan), *mesh_entries(tp_mesh, ep_mesh)],
        group=group,
    )
    ties = index_of(model, plan.index).ties
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

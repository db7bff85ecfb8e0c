"""Tied parameters of a transformers model (``lm_head.weight`` holding the embedding's): a tie
whose two sides a plan places differently refused. The ties a model holds are the model index's
(``ModelIndex.ties``)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Placement
from transformers import PreTrainedModel
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

from meshbind.errors import PlanProblem, ProblemCode
from meshbind.interop.hf_styles import PLANS, Rules, style_placement


def tie_problems(model: PreTrainedModel, groups: Mapping[str, Mapping[str, Rules]]) -> list[PlanProblem]:
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


def _placed_by_rules(groups: Mapping[str, Mapping[str, Rules]], fqn: str, ndim: int) -> dict[str, Placement]:
    """The placement per plan that the rules give the parameter ``fqn`` (none: whole)."""
    module, _, parameter = fqn.rpartition(".")
    group = groups.get(replace_layer_number_by_wildcard(module), {})
    placed = {}
    for kind, rules in group.items():
        style = rules.style_of(parameter)
        if style is not None:
            placed[kind] = style_placement(ALL_PARALLEL_STYLES[style], parameter, ndim)
    return placed

"""What ``check`` and ``bench`` run on: the user's model built on meta and its plan, from a
factory and a plan (meshbind's requests or a torch plan), or from a transformers config."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshbind.cli.arguments import UsageError
from meshbind.interop.torch_plans import from_torch_plan
from meshbind.specs import NativeParallelBindingRequest


def model_and_plan(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The model on meta and its requests: MODEL_FACTORY with PLAN or --torch-plan, or --hf-config."""
    if args.hf_config is None:
        return _factory_model_and_plan(args)
    if args.model_factory or args.plan or args.torch_plan:
        raise UsageError("--hf-config builds the model and reads its own plans: give no MODEL_FACTORY, PLAN or --torch-plan")
    return _hf_model_and_plan(args)


def _factory_model_and_plan(args: argparse.Namespace) -> tuple[torch.nn.Module, Sequence[NativeParallelBindingRequest]]:
    """MODEL_FACTORY built on meta, and PLAN or --torch-plan."""
    # The references may name the user's own modules in the working directory, which the
    # `meshbind` script (whose own folder heads sys.path) would not find; `python -m` would.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.model_factory is None:
        raise UsageError("give a MODEL_FACTORY (module:function), or --hf-config CONFIG.json")
    if args.strict:
        raise UsageError("--strict is for --hf-config: transformers plans only warn about keys that select nothing")
    factory = _load(args.model_factory, "MODEL_FACTORY")
    if not callable(factory):
        raise UsageError(f"MODEL_FACTORY {args.model_factory} is not callable")
    if args.torch_plan and args.plan:
        raise UsageError("give a PLAN or --torch-plan, not both")
    requests = _torch_plan_requests(args.torch_plan) if args.torch_plan else _plan_requests(args.plan)
    print(f"building {args.model_factory} on meta ...", file=sys.stderr)
    with torch.device("meta"):
        model = _user_code(f"MODEL_FACTORY {args.model_factory}", factory)
    args.build = lambda: _user_code(f"MODEL_FACTORY {args.model_factory}", factory)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"MODEL_FACTORY {args.model_factory} returned {type(model).__name__}, not an nn.Module")
    return model, requests


MAX_CONFIG_CHARS = 16 * 2**20
"""The longest --hf-config read (a config.json is kilobytes; the limit keeps /dev/zero from being read forever)."""


def _hf_model_and_plan(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """--hf-config: a transformers config file (its ``model_type`` names the class), the model built
    from it on meta (no weights, no network), and its own plans."""
    path, strict = args.hf_config, args.strict
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(MAX_CONFIG_CHARS + 1)
        if len(text) > MAX_CONFIG_CHARS:
            raise UsageError(f"--hf-config {path}: longer than {MAX_CONFIG_CHARS:,} characters; a config.json is a few kilobytes")
        values = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--hf-config {path}: {error}") from None
    except RecursionError:
        raise UsageError(f"--hf-config {path}: its JSON is nested too deep to be a config") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise UsageError(f"--hf-config {path}: a transformers config.json is an object with a 'model_type'")
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from meshbind.interop.hf_facts import defaulted_facts
    from meshbind.interop.hf_plans import from_hf_plan

    model_type = values.pop("model_type")
    config = _user_code(f"--hf-config {path}", lambda: AutoConfig.for_model(model_type, **values))
    for name, value in defaulted_facts(config.get_text_config(), values).items():
        print(
            f"--hf-config {path}: the file sets no {name}: checked against {value}, {type(config).__name__}'s default",
            file=sys.stderr,
        )
    # FSDP2's mixed precision keeps float32 shards (the master copy) and gathers in --param-dtype,
    # as torchtitan trains: the config's own dtype is what a checkpoint is stored in.
    dtype = {"dtype": torch.float32} if getattr(args, "param_dtype", None) is not None else {}
    built_in = " in float32 (--param-dtype)" if dtype else ""
    print(f"building {type(config).__name__} ({model_type}) on meta{built_in} ...", file=sys.stderr)

    def build() -> Any:
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(config, **dtype)  # type: ignore[no-untyped-call]
            except ValueError:  # not a causal LM: the base model
                return AutoModel.from_config(config, **dtype)  # type: ignore[no-untyped-call]

    model = _user_code(f"--hf-config {path}: building the model", build)
    args.build = lambda: _user_code(f"--hf-config {path}: building the model", build)
    args.max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    return model, from_hf_plan(model, strict=strict)


def _plan_requests(reference: str | None) -> Sequence[NativeParallelBindingRequest]:
    """PLAN: a sequence of requests, or a function returning one."""
    if reference is None:
        raise UsageError("give a PLAN (module:attribute) or --torch-plan module:attribute")
    plan_object = _load(reference, "PLAN")
    requests = _user_code(f"PLAN {reference}", plan_object) if callable(plan_object) else plan_object
    if isinstance(requests, NativeParallelBindingRequest):
        requests = (requests,)
    if (
        isinstance(requests, str)
        or not isinstance(requests, Sequence)
        or not all(isinstance(r, NativeParallelBindingRequest) for r in requests)
    ):
        raise UsageError(f"PLAN {reference} must be, or return, a sequence of NativeParallelBindingRequest")
    return requests


def _torch_plan_requests(reference: str) -> Sequence[NativeParallelBindingRequest]:
    """--torch-plan: a parallelize_module dict (FQN key → ParallelStyle), or a function returning one."""
    plan_object = _load(reference, "--torch-plan")
    plan = _user_code(f"--torch-plan {reference}", plan_object) if callable(plan_object) else plan_object
    try:
        return from_torch_plan(plan)
    except TypeError as error:
        raise UsageError(f"--torch-plan {reference}: {error}") from None


def _load(reference: str, what: str) -> Any:
    """``package.module:attribute`` → the attribute."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"{what} must be written module:attribute, got {reference!r}")
    module = _user_code(f"{what} {reference}: importing {module_name!r}", lambda: importlib.import_module(module_name))
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise UsageError(f"{what} {reference}: module {module_name!r} has no attribute {attribute!r}") from None


def _user_code(what: str, call: Callable[[], Any]) -> Any:
    """Runs the user's code (an import, a factory, a plan function): whatever it raises is a
    one-line error naming what ran and where it failed."""
    try:
        return call()
    except SystemExit as error:  # exit() in a factory is no model: never a silent success
        raise UsageError(f"{what} called exit({error.code!r})") from None
    except Exception as error:
        frames = traceback.extract_tb(error.__traceback__)
        where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        raise UsageError(f"{what} raised {type(error).__name__}: {error}{where}") from error

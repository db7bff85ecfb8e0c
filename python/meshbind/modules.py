"""Finding a module of a model by its FQN, through the wrappers torch puts around modules."""

from __future__ import annotations

from torch import nn

from meshbind.errors import BindingRefusedError

WRAPPED_MODULE_CHILDREN = ("_checkpoint_wrapped_module", "_orig_mod")
"""The only child through which a torch wrapper holds the module it wraps (activation
checkpointing, ``torch.compile``). FQNs leave wrappers out, as ``torch.distributed.checkpoint``'s
canonical FQNs do, so a plan bound before the wrappers still finds its modules after them."""


def submodule(model: nn.Module, fqn: str) -> nn.Module:
    """The module at ``fqn``, found by the ``_modules`` lookups ``named_modules()`` made (cheaper
    than ``get_submodule``'s attribute access at every level), through any torch wrapper."""
    module = unwrapped(model)
    for depth, name in enumerate(fqn.split(".") if fqn else ()):
        child = module._modules.get(name)
        if child is None:
            parent = ".".join(fqn.split(".")[:depth])
            where = repr(parent) if parent else "the root"
            message = f"the plan names {fqn!r}, which this model does not have: {where} has no child {name!r}"
            raise BindingRefusedError("module", message)
        module = unwrapped(child)
    return module


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a chain of torch wrappers (``WRAPPED_MODULE_CHILDREN``) holds; ``module`` itself when none wraps it."""
    while len(module._modules) == 1:
        name, inner = next(iter(module._modules.items()))
        if name not in WRAPPED_MODULE_CHILDREN or inner is None:
            break
        module = inner
    return module

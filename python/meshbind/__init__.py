"""meshbind: resolve, validate and bind large-model parallel plans onto PyTorch module trees."""

from meshbind._core import ModuleTree, PatternError, PatternSet

__all__ = ["ModuleTree", "PatternError", "PatternSet"]

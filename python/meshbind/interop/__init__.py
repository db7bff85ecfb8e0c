"""The plans users already have, checked by meshbind and applied by the framework
that owns them."""

HF_PROTOCOL = "hf_parallel_style"
"""The protocol of every spec ``from_hf_plan`` makes (here, so that telling a transformers plan
apart needs no transformers)."""

"""The GPUs a step time is estimated for, by their data sheets, and the cluster they sit in.

Every figure is the maker's published one (docs/design.md names each sheet): dense peaks (half
of the "with sparsity" figures the sheets print first), HBM bandwidth, and NVLink's bandwidth in
one direction (half the bidirectional total the sheets print), which is what nccl-tests' bus
bandwidth is measured against."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TERA = 10**12
GIGA = 10**9


@dataclass(frozen=True)
class Gpu:
    """One GPU model's published peaks."""

    name: str
    half_flops: float
    """Dense bf16/fp16 tensor-core FLOP/s."""
    single_flops: float
    """Dense fp32 FLOP/s without tensor cores (torch runs fp32 matmuls so unless TF32 is allowed)."""
    memory_bandwidth: float
    """HBM bytes/s."""
    nvlink_bandwidth: float
    """NVLink bytes/s in one direction."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bf16_tflops": self.half_flops / TERA,
            "fp32_tflops": self.single_flops / TERA,
            "hbm_gb_per_s": self.memory_bandwidth / GIGA,
            "nvlink_gb_per_s": self.nvlink_bandwidth / GIGA,
        }


GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("H100-SXM", 989 * TERA, 67 * TERA, 3350 * GIGA, 450 * GIGA),
        Gpu("H200", 989 * TERA, 67 * TERA, 4800 * GIGA, 450 * GIGA),
        Gpu("A100-80GB", 312 * TERA, 19.5 * TERA, 2039 * GIGA, 300 * GIGA),
        Gpu("B200", 2250 * TERA, 75 * TERA, 8000 * GIGA, 900 * GIGA),
    )
}
"""The GPUs ``--gpu`` names."""


def gpu_named(name: str) -> Gpu:
    """The GPU ``name`` (any case); a ``ValueError`` listing the choices otherwise."""
    by_lower = {key.lower(): gpu for key, gpu in GPUS.items()}
    if not isinstance(name, str) or name.lower() not in by_lower:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {name!r}")
    return by_lower[name.lower()]


_LINK = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(gbps|gb/s|gbit/s|gbytes/s)\s*$", re.IGNORECASE)


def link_bytes_per_second(text: str) -> float:
    """``400Gbps`` (bits, as network cards are sold) or ``50GB/s`` (bytes): bytes per second."""
    match = _LINK.match(text) if isinstance(text, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"inter-node bandwidth must be like 400Gbps or 50GB/s, got {text!r}")
    value = float(match.group(1)) * GIGA
    return value / 8 if match.group(2).lower() in ("gbps", "gbit/s") else value


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs joined by NVLink, each GPU with its own inter-node link of
    ``inter_node_bandwidth`` bytes/s (one network card per GPU, as DGX and HGX nodes have).
    Ranks fill nodes in order: rank ``r`` is on node ``r // gpus_per_node``."""

    gpu: Gpu
    gpus_per_node: int = 8
    inter_node_bandwidth: float = 50 * GIGA

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive int, got {self.gpus_per_node!r}")
        if not self.inter_node_bandwidth > 0:
            raise ValueError(f"inter_node_bandwidth must be positive bytes/s, got {self.inter_node_bandwidth!r}")

    def link_bandwidth(self, lowest_rank: int, highest_rank: int) -> float:
        """The bandwidth of a group whose ranks run from ``lowest_rank`` to ``highest_rank``:
        NVLink within one node, else the inter-node link (a ring across nodes runs at its slowest hop)."""
        same_node = lowest_rank // self.gpus_per_node == highest_rank // self.gpus_per_node
        return self.gpu.nvlink_bandwidth if same_node else self.inter_node_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.to_dict(),
            "gpus_per_node": self.gpus_per_node,
            "inter_node_gb_per_s": self.inter_node_bandwidth / GIGA,
        }

    def text(self) -> str:
        return (
            f"{self.gpu.name} ({self.gpu.half_flops / TERA:.0f} bf16 TFLOP/s, {self.gpu.memory_bandwidth / GIGA:.0f} GB/s HBM), "
            f"{self.gpus_per_node} per node over NVLink ({self.gpu.nvlink_bandwidth / GIGA:.0f} GB/s), "
            f"{self.inter_node_bandwidth * 8 / GIGA:.0f} Gbps between nodes"
        )

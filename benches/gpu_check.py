"""GPU check: the EP and CP round trips on CUDA over NCCL, in a world of one process, and the
step-memory estimate against the device's own peak.

    python benches/gpu_check.py                          # 1 GPU, NCCL (the point of this script)
    python benches/gpu_check.py --device cpu --backend gloo   # the same code path on a CPU

Nothing in meshbind assumes a CPU: the device comes from the mesh. This runs the collectives
(all-gather with a reduce-scatter backward, the uneven all-to-all of dispatch and combine) on the
device against single-process references in float64, and exits non-zero on any difference. Then
one training step of the demo's model (Adam, the step after the first) runs on the device: its
peak (``torch.cuda.max_memory_allocated()``; on a CPU the allocator's record through the
profiler) must be within 10% of ``step_memory(..., device=...)``, traced before the world starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from meshbind import CPContext, EPContext, LayoutContext, MeshBinding, MeshContext, resolve_plan, step_memory
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, batch, initialize, loss_head_request
from meshbind.launch import free_port
from meshbind.memory.step import apply_plan, make_optimizer, make_optimizer_state, training_step
from meshbind.names import ActivationCheckpointing, Checkpointing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from step_memory_truth import measured_step_peak


def check_cp(context: MeshContext, device: torch.device) -> float:
    cp = CPContext(MeshBinding(context).axis_mesh("cp"))
    x = torch.randn(2, 16, 8, dtype=torch.float64, device=device)
    local = cp.shard_sequence(x, 1).detach().requires_grad_()
    full = cp.unshard_sequence(local, 1)
    gathered = cp.all_gather(local, 1)
    weights = torch.randn_like(x)
    ((full * weights).sum() + gathered.sum()).backward()
    assert local.grad is not None
    errors = [
        (full - x).abs().max(),
        (gathered - x.index_select(1, cp.gathered_positions(16, device=device))).abs().max(),
        (local.grad - (weights + 1).index_select(1, cp.positions(16, device=device))).abs().max(),
    ]
    return float(torch.stack(errors).max().detach())


def check_ep(context: MeshContext, device: torch.device) -> float:
    num_experts, hidden, tokens_count = 8, 16, 64
    ep = EPContext(MeshBinding(context).axis_mesh("ep"), num_experts)
    experts = torch.randn(num_experts, hidden, hidden, dtype=torch.float64, device=device, requires_grad=True)
    tokens = torch.randn(tokens_count, hidden, dtype=torch.float64, device=device, requires_grad=True)
    expert_ids = torch.randint(0, num_experts, (tokens_count, 2), device=device)
    weights = torch.rand(tokens_count, 2, dtype=torch.float64, device=device)
    routed = ep.dispatch(tokens, expert_ids)
    out = ep.combine(torch.einsum("rh,rhg->rg", routed.tokens, experts[routed.local_expert_ids]), routed, weights)
    out.sum().backward()
    assert tokens.grad is not None and experts.grad is not None
    got = (out.detach(), tokens.grad.clone(), experts.grad.clone())
    tokens.grad, experts.grad = None, None
    reference = sum(torch.einsum("th,thg->tg", tokens, experts[expert_ids[:, k]]) * weights[:, k : k + 1] for k in range(2))
    reference.sum().backward()
    assert tokens.grad is not None and experts.grad is not None
    expected = (reference.detach(), tokens.grad, experts.grad)
    return max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))


STEP = TransformerConfig(layers=4, experts=8)
STEP_BATCH, STEP_SEQ = 4, 256


def estimate_step(device: torch.device) -> int:
    """The traced peak of one demo step on one rank (no process group may exist yet)."""
    with torch.device("meta"):
        model = MoETransformer(STEP)
    plan = resolve_plan(model, [loss_head_request()], LayoutContext({"cp": 1, "tp": 1, "ep": 1}), index=True)
    answer = step_memory(lambda: MoETransformer(STEP), plan, batch=STEP_BATCH, seq_len=STEP_SEQ, device=device.type)
    return answer.peak_bytes


def measure_step(context: MeshContext, device: torch.device) -> int:
    """One real demo step on ``device``: its peak, everything allocated for it included."""
    with torch.device("meta"):
        model = MoETransformer(STEP)
    plan = resolve_plan(model, [loss_head_request()], context.layout_context())
    apply_plan(model, plan, context, Checkpointing(ActivationCheckpointing.NONE))
    model.to_empty(device=device)
    initialize(model, seed=0)
    optimizer = make_optimizer(model, "adam", device.type)
    make_optimizer_state(optimizer)
    tokens, targets = batch(STEP, STEP_BATCH, STEP_SEQ, seed=0)
    tokens, targets = tokens.to(device), targets.to(device)
    if device.type != "cuda":
        return measured_step_peak(model, optimizer, (tokens, targets), {})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    training_step(model, optimizer, (tokens, targets), {})
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="nccl")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    estimated = estimate_step(device)
    dist.init_process_group(args.backend, rank=0, world_size=1)
    try:
        started = time.perf_counter()
        context = MeshContext.build(dp=1, cp=1, tp=1, ep=1, device_type=device.type)
        # ep = 1 builds no expert mesh; wrap one so EP runs over a real (one-rank) group as well.
        expert_mesh = torch.distributed.device_mesh.init_device_mesh(
            device.type, (1, 1, 1), mesh_dim_names=("edp_replicate", "edp_shard", "ep")
        )
        context = MeshContext(context.device_mesh, expert_mesh)
        torch.manual_seed(0)
        cp_error, ep_error = check_cp(context, device), check_ep(context, device)
        elapsed = time.perf_counter() - started
        measured = measure_step(context, device)
    finally:
        dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name} {args.backend}: CP round trip max error {cp_error:.2e}, EP round trip max error {ep_error:.2e}, {elapsed:.2f} s"
    )
    memory_error = estimated / measured - 1
    print(f"{name}: one demo step's peak {measured} bytes measured, {estimated} estimated ({memory_error:+.1%})")
    return 0 if max(cp_error, ep_error) <= 1e-10 and abs(memory_error) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())

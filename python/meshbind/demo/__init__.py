"""The main job (``meshbind demo``): a MoE transformer with CP attention and EP experts, planned, validated and bound
on a real world, checked against the same model in one process.

    meshbind demo [flags]                                  # spawns a local gloo world (4 ranks)
    torchrun --nproc-per-node 4 -m meshbind.demo [flags]   # the distributed half, under torchrun

On every rank: ``MeshContext.build`` → build on ``meta`` → ``resolve_plan`` → ``apply_layouts``
(parameters become DTensors on the meshes) → ``bind_parallel_modules`` → materialise (``to_empty`` + deterministic init) →
``validate_materialized_modules`` → forward and backward on a seeded batch → gradient reduction.
Rank 0 then runs the single-process reference and reports the largest differences.
"""

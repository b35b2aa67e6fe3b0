"""torchrun entry points: one rank of a real multi-process world (gloo on CPU, nccl on GPU).

Each worker transforms the model itself (deterministic: the same SPMD program on every rank),
binds its process groups through ``dcp_compile.runtime.world.bind_roles`` and runs the engine:

    torchrun --nproc-per-node 4 -m dcp_compile.workers.decode --dcp 2 --out tokens.json
    torchrun --nproc-per-node 4 -m dcp_compile.workers.prefill --dcp 2 ...
    torchrun --nproc-per-node 4 -m dcp_compile.workers.compiled --dcp 2 ...   (torch.compile)
    torchrun --nproc-per-node 4 -m dcp_compile.workers.disagg prefill|decode ...   (NIXL)

They live in ``dcp_compile`` (not ``runtime``) because they use its frontends.
"""

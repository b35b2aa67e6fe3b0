"""What executes a DCP program: worlds of ranks, paged KV caches, host-side metadata.

Modules (import the one you need; this package imports nothing heavy):

- ``dcp_compile.runtime.world``  — ``run_threaded``: one SPMD function on N threads of this process with a
  real threaded process group; ``bind_roles``: create the process groups of every role of a
  ``Topology`` and return role -> ``group_name`` for ``torch.ops._c10d_functional.*``;
  ``each_rank_in_turn``: trace (fx.symbolic_trace) safely inside a threaded world.
- ``dcp_compile.runtime.launch`` — torchrun + gloo on 127.0.0.1: ``init_distributed_from_env``,
  ``torchrun_command``, ``run_torchrun``.
"""

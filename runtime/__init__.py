"""What executes a DCP program: worlds of ranks, paged KV caches, host-side metadata.

The top level holds what every room reads: the layout formulas (``layout``), the validated
configuration (``config``), process groups by role (``topology``), shared names and enums
(``names``), the exception types (``errors``) and the version. The rooms, by job:

- ``program``      a DCP program and its files: ``DCPProgram``, program files, model facts,
  weight shards, context buckets;
- ``serving``      rank loading and the engine: a program on one rank, the step contract, the
  paged KV cache, host metadata, the greedy / speculative / prefix-cached loops;
- ``kernels``      the ``dcp`` custom ops: definitions, reference bodies, eager kernels;
- ``distributed``  worlds, launch and collectives: threaded and torchrun worlds, group roles,
  the Neuron backend;
- ``transfer``     moving KV between layouts and engines: host-side cache layouts, the
  prefill -> decode transfer plan, NIXL.

Import the module you need; this package imports nothing heavy.
"""

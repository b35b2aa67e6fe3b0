"""Program files: a DCPProgram saved once, loaded by every rank of a launch.

Every rank of a world runs the same SPMD program, so one process transforms the model and
writes the program (``save_program``); each rank reads it (``load_program``) instead of
transforming the model again. A file holds data only: each graph as its list of nodes (op,
target by name, arguments, the node metadata the runtime reads), the weights as tensors,
and the layout (config, topology, shapes, shard specs, model facts) as named fields. It is
read with ``torch.load(weights_only=True)``, so loading runs no code from the file and no
pass: it looks ops up by name (ATen, collectives, the ``dcp`` ops of runtime/kernels/ops.py and
runtime/kernels/moe.py) and rebuilds each GraphModule.

A file is a header (versions, the body's length and SHA-256) and the ``torch.save`` body; a
truncated, corrupt or forged file is refused by the header, the hash or the schema
(:mod:`.schema`) before anything is built from it, with a DCPInputError naming the file.

What a file leaves out: the compile report (pass history, proof certificate, check report),
the dump directory and the mask theorems (the certificate's input), which belong to the
compiler; and node metadata that only capture and the passes read (module stacks, source
functions). A file names the dcp_compile and torch versions that wrote it and is refused
by any other (the graph's ops and the runtime's calling convention may change between
releases): transform the model again with the version that loads it.
"""

from __future__ import annotations

import os

from dcp_compile.runtime.program.codec import read_program_fields, save_program
from dcp_compile.runtime.program.dcp_program import DCPProgram

__all__ = ["load_program", "save_program"]


def load_program(path: str | os.PathLike) -> DCPProgram:
    """The program ``save_program`` wrote to ``path``; refuses a file that is not one, or
    one another dcp_compile or torch version wrote."""
    return DCPProgram(**read_program_fields(path))

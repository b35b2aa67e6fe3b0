"""torchrun entry points: one rank of a real multi-process world (gloo on CPU, nccl on GPU).

Each worker transforms the model itself (deterministic: the same SPMD program on every rank),
or, with ``--program PATH``, loads the program file one process wrote for the whole launch
(``program.save(PATH)``; runtime/program/program_file.py), binds its process groups through
``dcp_compile.runtime.distributed.world.bind_roles`` and runs the engine:

    torchrun --nproc-per-node 4 -m dcp_compile.workers.decode --dcp 2 --out tokens.json
    torchrun --nproc-per-node 4 -m dcp_compile.workers.prefill --dcp 2 ...
    torchrun --nproc-per-node 4 -m dcp_compile.workers.compiled --dcp 2 ...   (torch.compile)
    torchrun --nproc-per-node 4 -m dcp_compile.workers.disagg prefill|decode ...   (NIXL)
    python -m dcp_compile.workers.supervise --nproc 4 --dcp 2 ...   (resumes after a rank loss;
        --mode prefill: a prefill-mode world)
    python -m dcp_compile.workers.supervise_pair ...   (a disaggregated pair, resumed likewise)

They live in ``dcp_compile`` (not ``runtime``) because they use its frontends.
"""

from __future__ import annotations

from typing import Callable

PROGRAM_HELP = ("a program file (program.save) of this launch's layout: every rank loads it "
                "instead of transforming the model")


CHECKPOINT_HELP = ("a checkpoint directory (config.json + *.safetensors) every rank reads only "
                   "its own weight shards from (a weightless program file needs one)")


def rank_check(rank: int) -> bool | None:
    """``transform(check=...)`` for a rank that transforms the model itself: transform's
    default on rank 0, off on the others. Every rank builds the same program, so rank 0's
    check speaks for all; a failing check stops rank 0, and the launch with it."""
    return None if rank == 0 else False


def program_for(path: str | None, build: Callable, **expected):
    """The program this rank runs: the program file at ``path`` when given (refused unless
    its config has every ``expected`` value, e.g. ``dcp=2, mode="decode"``), else
    ``build()`` (this rank transforms the model itself)."""
    if not path:
        return build()
    from dcp_compile.runtime.errors import DCPInputError
    from dcp_compile.runtime.program.program_file import load_program
    program = load_program(path)
    wrong = {k: (getattr(program.config, k), v) for k, v in expected.items()
             if v is not None and getattr(program.config, k) != v}
    if wrong:
        raise DCPInputError(
            f"program file {path} does not fit this launch: "
            + ", ".join(f"its {k}={have!r}, the launch asks {k}={want!r}"
                        for k, (have, want) in wrong.items())
            + ". Write the program with the launch's layout, or launch with the file's.")
    return program

"""Self-test of a world: bind the roles of a topology, check functional collectives on them.

Under torchrun (gloo, one process per rank)::

    python -m torch.distributed.run --nproc-per-node 4 ... -m tests.support.selftest_worker \
        --dcp 2 --mode prefill --roles cp_kv dcp_tp

Each rank prints ``selftest ok rank=<r> checks=<n>`` and exits 0, or raises on the first
mismatch. :func:`check_collectives` is the same check, callable from any world (the threaded
tests use it too).

Every check compares a collective's result with the value computed locally from the known
per-rank inputs: all_gather_into_tensor, reduce_scatter_tensor("sum"), all_reduce("sum") and
all_to_all_single (equal splits), each followed by wait_tensor, called eagerly and from an
``fx.GraphModule`` built by hand with those op nodes. Inputs are small integers, so sums are
exact in every dtype checked (bfloat16 included).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch
import torch.fx as fx

F = torch.ops._c10d_functional
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
_COLS = 3


def rank_input(rank: int, rows: int, dtype: torch.dtype, *, small: bool = False) -> torch.Tensor:
    """The input every check feeds on ``rank``: distinct per rank, or (``small``) values < 8
    whose sums over up to 32 ranks stay exact in bfloat16."""
    idx = torch.arange(rows * _COLS).reshape(rows, _COLS)
    x = (idx + 3 * rank) % 8 if small else idx % 16 + 16 * rank
    return x.to(dtype)


def expected(kind: str, members: Sequence[int], rank: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``kind`` over the group ``members`` (global ranks, ascending) returns on ``rank``."""
    n, me = len(members), members.index(rank)
    rows = 2 * n
    if kind == "all_gather":
        return torch.cat([rank_input(r, rows, dtype) for r in members])
    if kind == "all_to_all":
        return torch.cat([rank_input(r, rows, dtype).chunk(n)[me] for r in members])
    total = sum(rank_input(r, rows, torch.int64, small=True) for r in members)
    if kind == "all_reduce":
        return total.to(dtype)
    return total.chunk(n)[me].to(dtype)


def _issue(kind: str, x, n: int, name: str, call):
    """Emit one collective + wait_tensor through ``call(op, *args)`` (eager or graph)."""
    if kind == "all_gather":
        out = call(F.all_gather_into_tensor.default, x, n, name)
    elif kind == "reduce_scatter":
        out = call(F.reduce_scatter_tensor.default, x, "sum", n, name)
    elif kind == "all_reduce":
        out = call(F.all_reduce.default, x, "sum", name)
    else:
        split = [2] * n  # rows = 2 * n: two rows to each member
        out = call(F.all_to_all_single.default, x, split, split, name)
    return call(F.wait_tensor.default, out)


def collective_graph(kinds: Sequence[str], group_size: int, group_name: str) -> fx.GraphModule:
    """A hand-built GraphModule: one input per kind, each through its collective + wait."""
    graph = fx.Graph()
    outs = []
    for kind in kinds:
        x = graph.placeholder(f"x_{kind}")
        outs.append(_issue(kind, x, group_size, group_name,
                           lambda op, *a: graph.call_function(op, tuple(a))))
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    gm.graph.lint()
    return gm


def _inputs(kinds, members, rank, dtype):
    rows = 2 * len(members)
    return [rank_input(rank, rows, dtype, small=kind in ("reduce_scatter", "all_reduce"))
            for kind in kinds]


def check_collectives(topology, rank: int, names: dict[str, str], *,
                      roles: Sequence[str] | None = None,
                      dtypes: Sequence[torch.dtype] = (torch.float32,),
                      kinds: Sequence[str] = KINDS, via: Sequence[str] = ("eager", "fx"),
                      graphs: dict | None = None) -> int:
    """Check ``kinds`` on this rank's group of each role, for each dtype and each way of
    calling. ``graphs`` optionally maps (role, dtype) -> a GraphModule to run instead of
    building one per rank (to run one graph on every rank). Returns the number of checks;
    raises AssertionError naming the first wrong result."""
    count = 0
    for role in roles or list(names):
        members = topology.group_of(role, rank)
        n, name = len(members), names[role]
        for dtype in dtypes:
            xs = _inputs(kinds, members, rank, dtype)
            for how in via:
                if how == "eager":
                    got = [_issue(k, x, n, name, lambda op, *a: op(*a))
                           for k, x in zip(kinds, xs)]
                else:
                    gm = (graphs or {}).get((role, dtype)) or collective_graph(kinds, n, name)
                    got = list(gm(*xs))
                for kind, y in zip(kinds, got):
                    want = expected(kind, members, rank, dtype)
                    if y.dtype != dtype or not torch.equal(y, want):
                        raise AssertionError(
                            f"{kind} over role {role} (group {members}, name {name!r}) via "
                            f"{how} in {dtype} is wrong on rank {rank}: got "
                            f"{y.flatten()[:8].tolist()} ({y.dtype}, {tuple(y.shape)}), want "
                            f"{want.flatten()[:8].tolist()} ({tuple(want.shape)}).")
                    count += 1
    return count


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--mode", default="prefill", choices=("prefill", "decode"))
    parser.add_argument("--roles", nargs="*", default=None,
                        help="roles to check (default: every role of the topology)")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16", "int64"])
    parser.add_argument("--aliases", action="store_true",
                        help="also bind rank-independent role names and run one shared graph")
    parser.add_argument("--fail-rank", type=int, default=None,
                        help="raise on this rank after binding (tests failure reporting)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse(argv)

    import torch.distributed as dist

    from dcp_compile.runtime.distributed.launch import init_distributed_from_env

    rank, world_size = init_distributed_from_env()
    try:
        run(opts, rank, world_size)
    finally:
        dist.destroy_process_group()
    return 0


def run(opts: argparse.Namespace, rank: int, world_size: int) -> None:
    """This rank's self-test in the initialised world (``main``, or tests/support/world_worker.py)."""
    from dcp_compile.runtime.topology import topology
    from dcp_compile.runtime.distributed.world import bind_roles

    topo = topology(world_size, opts.dcp, opts.mode)
    dtypes = [getattr(torch, d) for d in opts.dtypes]
    names = bind_roles(topo, rank)
    if opts.fail_rank == rank:
        raise RuntimeError(f"selftest: deliberate failure on rank {rank}")
    count = check_collectives(topo, rank, names, roles=opts.roles, dtypes=dtypes)
    if opts.aliases:
        alias = bind_roles(topo, rank, aliases=True)
        roles = opts.roles or list(alias)
        graphs = {(role, dt): collective_graph(KINDS, len(topo.group_of(role, rank)),
                                               alias[role])
                  for role in roles for dt in dtypes}
        count += check_collectives(topo, rank, alias, roles=roles, dtypes=dtypes,
                                   via=("fx",), graphs=graphs)
    print(f"selftest ok rank={rank} checks={count} names={names}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

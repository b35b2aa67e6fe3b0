"""Worlds: threaded (one process) and torchrun + gloo; functional collectives on role groups."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from dcp_compile.runtime.errors import DCPWorldError
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.distributed import launch
from selftest_worker import (KINDS, check_collectives, collective_graph, expected,
                                      rank_input)
from dcp_compile.runtime.distributed.world import ROLE_ALIAS_PREFIX, bind_roles, each_rank_in_turn, run_threaded

F = torch.ops._c10d_functional
W = F.wait_tensor.default

# (mode, tp, dcp): strided and consecutive groups, size-1 groups, groups equal to the world.
TOPOLOGIES = [
    pytest.param("prefill", 4, 2, id="prefill-tp4-dcp2"),
    pytest.param("prefill", 8, 2, id="prefill-tp8-dcp2"),
    pytest.param("prefill", 4, 4, id="prefill-tp4-dcp4-singleton-dcp_tp"),
    pytest.param("decode", 4, 2, id="decode-tp4-dcp2"),
    pytest.param("decode", 8, 4, id="decode-tp8-dcp4"),
    pytest.param("decode", 2, 2, id="decode-tp2-dcp2-dcp-is-world"),
    pytest.param("decode", 4, 1, id="decode-tp4-dcp1-singleton-dcp"),
    pytest.param("prefill", 2, 1, id="prefill-tp2-dcp1-singleton-cp_kv"),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)


def _group_ranks(name: str) -> list[int]:
    pg = torch._C._distributed_c10d._resolve_process_group(name)
    return dist.get_process_group_ranks(pg)


# --- run_threaded -------------------------------------------------------------------------

def test_results_in_rank_order_and_rank_is_data():
    def fn(rank, scale):
        x = torch.tensor([float(rank)])
        total = W(F.all_reduce(x, "sum", dist.group.WORLD.group_name))
        return rank * scale, dist.get_rank(), total.item()

    assert run_threaded(3, fn, 10) == [(0, 0, 3.0), (10, 1, 3.0), (20, 2, 3.0)]
    assert run_threaded(1, fn, 10) == [(0, 0, 0.0)]


def test_world_is_torn_down_and_reusable():
    for _ in range(3):
        assert run_threaded(2, lambda rank: dist.is_initialized()) == [True, True]
    assert not dist.is_initialized()
    # The C++ group registry is global again: a threaded group name no longer resolves here.
    with pytest.raises(RuntimeError, match="Could not resolve"):
        torch._C._distributed_c10d._resolve_process_group("0")


def test_grad_mode_carries_into_rank_threads():
    with torch.no_grad():
        assert run_threaded(2, lambda rank: torch.is_grad_enabled()) == [False, False]
    assert run_threaded(2, lambda rank: torch.is_grad_enabled()) == [True, True]


def _fail_on_rank_2(rank):
    x = torch.ones(2)
    if rank == 2:
        raise ValueError("boom on purpose")
    return W(F.all_reduce(x, "sum", dist.group.WORLD.group_name))  # others block here


def test_rank_exception_names_rank_and_does_not_hang():
    start = time.monotonic()
    with pytest.raises(DCPWorldError, match=r"rank 2 of 4 raised ValueError: boom") as info:
        run_threaded(4, _fail_on_rank_2, timeout=60)
    assert time.monotonic() - start < 10  # the blocked ranks were woken, not timed out
    err = info.value
    assert isinstance(err.__cause__, ValueError)
    assert set(err.failures) >= {2} and err.timed_out == []
    assert "_fail_on_rank_2" in err.failures[2] and "_fail_on_rank_2" in str(err)
    assert "were stopped in a collective" in str(err)
    # The next world starts clean.
    assert run_threaded(4, lambda r: W(F.all_reduce(torch.ones(1), "sum", "0")).item()) == [4.0] * 4


def test_mismatched_collectives_time_out_with_stacks():
    def fn(rank):
        if rank != 0:  # rank 0 never joins: the others wait in the collective
            W(F.all_reduce(torch.ones(1), "sum", dist.group.WORLD.group_name))

    start = time.monotonic()
    with pytest.raises(DCPWorldError, match="did not finish in 1.0 s") as info:
        run_threaded(3, fn, timeout=1.0)
    assert time.monotonic() - start < 6
    assert info.value.timed_out == [1, 2]
    assert "stuck at" in info.value.failures[1] and "in fn" in info.value.failures[1]
    assert run_threaded(2, lambda r: r) == [0, 1]


def test_rank_failing_before_bind_stops_the_others_in_new_group():
    """The others wait in new_group's store barrier (C++); the world's store ends that wait
    when rank 1 fails, long before the timeout, and no thread is left behind."""
    topo = topology(4, 2, "prefill")

    def fn(rank):
        if rank == 1:
            raise ValueError("failed before binding")
        bind_roles(topo, rank)

    with pytest.raises(DCPWorldError, match="rank 1 of 4 raised ValueError") as info:
        run_threaded(4, fn, timeout=600)
    assert info.value.timed_out == [] and info.value.leaked == []  # stopped, not timed out
    assert "Ranks [0, 2, 3] were stopped" in str(info.value)
    assert "new_group" in info.value.failures[0]
    assert not [t for t in threading.enumerate() if t.name.startswith("dcp-rank-")]
    for _ in range(3):
        assert run_threaded(4, lambda r: W(F.all_reduce(
            torch.ones(1), "sum", bind_roles(topo, r)["cp_kv"])).item()) == [2.0] * 4


def test_nested_world_is_rejected():
    def fn(rank):
        run_threaded(2, lambda r: r)

    with pytest.raises(DCPWorldError, match="Nested threaded worlds") as info:
        run_threaded(2, fn)
    assert isinstance(info.value.__cause__, DCPWorldError)


def test_concurrent_callers_are_serialised():
    out = {}

    def caller(i):
        out[i] = run_threaded(2, lambda r: W(F.all_reduce(torch.ones(1) * i, "sum", "0")).item())

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {i: [2.0 * i] * 2 for i in range(3)}


# --- bind_roles ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode,tp,dcp", TOPOLOGIES)
def test_bind_roles_groups_match_topology(mode, tp, dcp):
    topo = topology(tp, dcp, mode)

    def fn(rank):
        names = bind_roles(topo, rank)
        return {role: _group_ranks(name) for role, name in names.items()}, names

    results = run_threaded(tp, fn)
    for rank, (groups, names) in enumerate(results):
        assert set(groups) == set(topo.groups)
        for role, ranks in groups.items():
            assert ranks == topo.group_of(role, rank)
        # Members of one group agree on its name; different groups have different names.
        for role in topo.groups:
            for other in range(tp):
                same = topo.group_of(role, rank) == topo.group_of(role, other)
                assert (results[other][1][role] == names[role]) == same


def test_bind_roles_reuses_identical_groups():
    topo = topology(4, 4, "decode")  # the dcp role's one group is the world

    def fn(rank):
        return bind_roles(topo, rank)

    assert run_threaded(4, fn) == [{"tp": "0", "dcp": "0"}] * 4


def test_bind_roles_rejects_wrong_world():
    topo = topology(4, 2, "prefill")
    with pytest.raises(DCPWorldError, match="needs an initialised process group"):
        bind_roles(topo, 0)
    with pytest.raises(DCPWorldError, match="world_size=2, topology.tp=4"):
        run_threaded(2, lambda rank: bind_roles(topo, rank))
    with pytest.raises(DCPWorldError, match="rank=1, dist.get_rank\\(\\)=0"):
        run_threaded(4, lambda rank: bind_roles(topo, (rank + 1) % 4))


# --- functional collectives with real data -------------------------------------------------

@pytest.mark.parametrize("mode,tp,dcp", TOPOLOGIES)
def test_functional_collectives_on_every_role(mode, tp, dcp):
    """all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single (+ wait),
    eager and from a hand-built GraphModule, in every dtype, on every role's groups."""
    topo = topology(tp, dcp, mode)

    def fn(rank):
        return check_collectives(topo, rank, bind_roles(topo, rank), dtypes=DTYPES)

    counts = run_threaded(tp, fn)
    assert counts == [len(topo.groups) * len(DTYPES) * 2 * len(KINDS)] * tp


class _Collectives(torch.nn.Module):
    """A module calling the functional collectives directly, for ``fx.symbolic_trace``."""

    def __init__(self, group_size, group_name):
        super().__init__()
        self.n, self.name = group_size, group_name

    def forward(self, x, y):
        g = W(F.all_gather_into_tensor(x, self.n, self.name))
        s = W(F.reduce_scatter_tensor(y, "sum", self.n, self.name))
        r = W(F.all_reduce(y, "sum", self.name))
        a = W(F.all_to_all_single(x, [2] * self.n, [2] * self.n, self.name))
        return g * 2, s, r, a


@pytest.mark.parametrize("role", ["cp_kv", "dcp_tp", "world"])
def test_symbolic_trace_bakes_group_names_per_rank(role):
    topo = topology(4, 2, "prefill")

    def fn(rank):
        names = bind_roles(topo, rank)
        members = topo.group_of(role, rank)
        # symbolic_trace patches nn.Module.__call__ process-wide: no rank may call a module
        # while another traces.
        gm = each_rank_in_turn(fx.symbolic_trace, _Collectives(len(members), names[role]))
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        x = rank_input(rank, 2 * len(members), torch.float32)
        y = rank_input(rank, 2 * len(members), torch.float32, small=True)
        g, s, r, a = gm(x, y)
        assert torch.equal(g, 2 * expected("all_gather", members, rank, torch.float32))
        assert torch.equal(s, expected("reduce_scatter", members, rank, torch.float32))
        assert torch.equal(r, expected("all_reduce", members, rank, torch.float32))
        assert torch.equal(a, expected("all_to_all", members, rank, torch.float32))
        return ops.count(W), names[role]

    results = run_threaded(4, fn)
    assert [count for count, _ in results] == [4] * 4


def test_aliases_let_one_graph_serve_every_rank():
    """With aliases, group names are the same on every rank: build the graphs once, outside
    the world, and run the very same GraphModule objects on all ranks."""
    topo = topology(8, 2, "prefill")
    graphs = {(role, torch.float32): collective_graph(KINDS, len(topo.groups[role][0]),
                                                      ROLE_ALIAS_PREFIX + role)
              for role in topo.groups}

    def fn(rank):
        names = bind_roles(topo, rank, aliases=True)
        assert names == {role: ROLE_ALIAS_PREFIX + role for role in topo.groups}
        assert {r: _group_ranks(n) for r, n in names.items()} == {
            r: topo.group_of(r, rank) for r in topo.groups}
        rebound = bind_roles(topo, rank, aliases=True)  # re-binding replaces the aliases
        assert rebound == names
        return check_collectives(topo, rank, names, via=("fx",), graphs=graphs)

    assert run_threaded(8, fn) == [len(topo.groups) * len(KINDS)] * 8


def test_non_contiguous_inputs():
    topo = topology(4, 2, "prefill")

    def fn(rank):
        name = bind_roles(topo, rank)["cp_kv"]
        members = topo.group_of("cp_kv", rank)
        base = torch.arange(24.0).reshape(4, 6) + 100 * rank
        x = base[:, 1:4]  # rows of 3 out of 6: not contiguous
        assert not x.is_contiguous()
        xt = base.t()[:4]  # a transposed view
        peer = {r: torch.arange(24.0).reshape(4, 6) + 100 * r for r in members}
        me = members.index(rank)
        ag = W(F.all_gather_into_tensor(x, 2, name))
        assert torch.equal(ag, torch.cat([peer[r][:, 1:4] for r in members]))
        rs = W(F.reduce_scatter_tensor(xt, "sum", 2, name))
        assert torch.equal(rs, sum(peer[r].t()[:4] for r in members).chunk(2)[me])
        ar = W(F.all_reduce(x, "sum", name))
        assert torch.equal(ar, sum(peer[r][:, 1:4] for r in members))
        a2a = W(F.all_to_all_single(xt, [2, 2], [2, 2], name))
        assert torch.equal(a2a, torch.cat([peer[r].t()[:4].chunk(2)[me] for r in members]))
        return True

    assert all(run_threaded(4, fn))


def test_all_to_all_single_uneven_splits():
    topo = topology(4, 2, "prefill")

    def rows(src, dst):  # rows that group rank src sends to group rank dst
        return src + 2 * dst + 1

    def fn(rank):
        name = bind_roles(topo, rank)["dcp_tp"]
        members = topo.group_of("dcp_tp", rank)
        me = members.index(rank)
        send = [rows(me, d) for d in range(2)]
        recv = [rows(s, me) for s in range(2)]
        x = torch.arange(float(sum(send))) + 100 * rank
        y = W(F.all_to_all_single(x, recv, send, name))
        want = []
        for s, src in enumerate(members):
            sx = torch.arange(float(sum(rows(s, d) for d in range(2)))) + 100 * src
            want.append(sx.split([rows(s, d) for d in range(2)])[me])
        assert torch.equal(y, torch.cat(want))
        return y.numel()

    assert run_threaded(4, fn) == [1 + 2, 3 + 4, 1 + 2, 3 + 4]


def test_reductions_the_threaded_pg_supports():
    topo = topology(4, 2, "prefill")

    def fn(rank):
        name = bind_roles(topo, rank)["cp_kv"]
        x = torch.tensor([float(rank + 1), 2.0])
        out = {op: W(F.all_reduce(x, op, name)).tolist()
               for op in ("sum", "avg", "max", "min", "product")}
        out["rs_avg"] = W(F.reduce_scatter_tensor(x, "avg", 2, name)).tolist()
        for op in ("max", "min", "product"):
            with pytest.raises(NotImplementedError, match="ReduceScatter does not support"):
                F.reduce_scatter_tensor(x, op, 2, name)
        return out

    r0 = run_threaded(4, fn)[0]  # group [0, 2]: inputs [1, 2] and [3, 2]
    assert r0 == {"sum": [4.0, 4.0], "avg": [2.0, 2.0], "max": [3.0, 2.0], "min": [1.0, 2.0],
                  "product": [3.0, 4.0], "rs_avg": [2.0]}


def test_all_to_all_single_needs_explicit_splits():
    """Empty split lists do not mean "equal splits" in the functional op: the output gets
    0 rows and the collective fails (on the rank that moves the data)."""
    def fn(rank):
        W(F.all_to_all_single(torch.ones(4), [], [], dist.group.WORLD.group_name))

    with pytest.raises(DCPWorldError, match="raised RuntimeError"):
        run_threaded(2, fn, timeout=30)


def test_group_name_of_another_group_does_not_resolve():
    """A rank knows only the groups it belongs to: another group's name fails loudly."""
    topo = topology(4, 2, "prefill")
    published: dict[int, dict[str, str]] = {}

    def fn(rank):
        published[rank] = bind_roles(topo, rank)
        W(F.all_reduce(torch.ones(1), "sum", "0"))  # barrier: every rank has published
        other = published[(rank + 1) % 4]["cp_kv"]  # the neighbour is in the other cp_kv group
        assert other != published[rank]["cp_kv"]
        with pytest.raises(RuntimeError, match="Could not resolve the process group"):
            F.all_reduce(torch.ones(1), "sum", other)
        return True

    assert all(run_threaded(4, fn))


# --- torchrun + gloo ----------------------------------------------------------------------

def test_torchrun_command_shape():
    cmd = launch.torchrun_command(4, "tests.support.selftest_worker", ["--dcp", 2], master_port=1234)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("--master-addr") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--master-port") + 1] == "1234"
    assert cmd[-4:] == ["-m", "tests.support.selftest_worker", "--dcp", "2"]
    cmd = launch.torchrun_command(2, "m")
    assert 0 < int(cmd[cmd.index("--master-port") + 1]) < 65536


def test_init_from_env_refuses_non_loopback(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("MASTER_ADDR", "8.8.8.8")
    with pytest.raises(DCPWorldError, match="not a loopback address"):
        launch.init_distributed_from_env()
    monkeypatch.delenv("RANK")
    with pytest.raises(DCPWorldError, match=r"missing: \['RANK'\]"):
        launch.init_distributed_from_env()


_SUMMARY = """\
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
[2]:
  rank      : 3 (local_rank: 3)
  exitcode  : -15 (pid: 14)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 12)
"""


def test_launch_error_puts_the_failing_rank_first(tmp_path):
    """Parsing of torchrun's failure summary and per-rank logs (format of torch 2.13)."""
    logs = {0: "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1",
            1: "ValueError: the real bug", 3: ""}
    for r, text in logs.items():
        d = tmp_path / "none_abc" / "attempt_0" / str(r)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text(text)
    import subprocess
    proc = subprocess.CompletedProcess(["python", "-m", "x"], 1, "", _SUMMARY)
    err = launch._launch_error(4, "x", proc, launch._rank_logs(tmp_path), False, 10)
    assert "rank 1 failed; ranks [0, 3] stopped after it" in str(err)
    assert "ValueError: the real bug" in str(err) and "Connection closed" not in str(err)
    assert list(err.failures) == [1, 0, 3]


_TEARDOWN_SCRIPT = """
import gc, os, sys, time
import torch, torch.distributed as dist
from dcp_compile.runtime.distributed.launch import init_distributed_from_env

def gloo_threads():
    tasks = os.listdir("/proc/self/task")
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    return sorted(n for n in names if "gloo" in n)

init_distributed_from_env()
# gloo starts and names its threads asynchronously: wait for them (a bounded poll).
deadline = time.monotonic() + 30
while not gloo_threads() and time.monotonic() < deadline:
    time.sleep(0.05)
assert gloo_threads(), "the gloo group runs no thread after 30 s: nothing to check"
import torch._dynamo  # first imported inside the world, as a transform or a program's step does
dist.destroy_process_group()
gc.collect()
print("gloo threads after destroy_process_group:", gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc (Linux)")
def test_destroy_process_group_leaves_no_gloo_thread(tmp_path):
    """torch._dynamo imported after init (a rank's transform or first step) must not keep the
    default gloo group alive: destroy_process_group frees it and joins its threads, so none
    is left running into interpreter shutdown (where one aborted a rank at exit)."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(launch.free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(launch._SOURCE_ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _TEARDOWN_SCRIPT], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gloo threads after destroy_process_group: []" in r.stdout, r.stdout + r.stderr[-2000:]

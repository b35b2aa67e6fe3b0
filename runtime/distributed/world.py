"""Worlds that run one SPMD function on many ranks with real collectives.

``run_threaded`` puts every rank on its own thread of this process, with torch's threaded
process group (``torch.testing._internal.distributed.multi_threaded_pg``): collectives move
real data between the threads, and ``torch.ops._c10d_functional.*`` resolve group names per
thread. ``bind_roles`` creates the process groups of a :class:`~dcp_compile.runtime.topology.Topology`
in whatever world is initialised (threaded here, gloo under torchrun — see ``dcp_compile.runtime.distributed.launch``).

Threaded-PG facts our programs rely on (each one is tested in ``tests/runtime/test_world.py``):

- A collective runs when it is issued (all members block in the op until the last one
  arrives); ``wait_tensor`` is then a no-op. So ranks must issue the collectives of one group
  in the same order — as on any real backend — but an out-of-order program deadlocks at the
  collective, not at ``wait_tensor``.
- all_reduce reduces the stacked members' tensors in one op (``sum``/``avg``/``min``/``max``/
  ``product``); reduce_scatter adds them one by one in group-rank order, in their dtype
  (``sum``/``avg`` only). Low-precision sums can differ in the last bit from gloo's.
- Only one threaded world can exist at a time in a process: ``run_threaded`` serialises
  callers, and a rank must not call ``run_threaded`` itself.
- Rank threads share process-wide state: ``fx.symbolic_trace`` patches ``nn.Module.__call__``
  while tracing, which breaks any module call on another rank meanwhile (trace before the
  world, or with :func:`each_rank_in_turn`), and the CPU random generator is shared.
- The threaded PG is more permissive than gloo in one way (an all_gather of a 0-d tensor
  works here, fails on gloo: gather shape-(1,) tensors) and stricter in another
  (reduce_scatter supports only ``sum``/``avg`` here; gloo also ``max``/``min``/``product``).
- Creating a group (``init_process_group``, ``new_group``) waits in a store barrier, in C++,
  that the PG's termination event cannot interrupt. Each world therefore gets its own
  :class:`_WorldStore`, whose waits end as soon as the world stops: a rank that fails before
  ``bind_roles`` stops the others at once, and no rank thread is left inside C++ (a daemon
  thread that wakes in C++ while the interpreter exits aborts the process with "terminate
  called without an active exception").

Hangs: after ``timeout`` the world is stopped; ranks blocked in a collective or a store wait
end within ``_STOP_GRACE``. A rank stuck elsewhere (pure Python, a long op) cannot be stopped:
it is reported by name in :class:`DCPWorldError` (``timed_out``, and ``leaked``), stays
listed by :func:`leaked_ranks` while it runs, is a daemon thread (it never blocks exit) and
cannot touch later worlds; at exit it is waited for briefly and named on stderr if still
running.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from dcp_compile.runtime.errors import DCPWorldError

if TYPE_CHECKING:
    from dcp_compile.runtime.topology import Topology

__all__ = ["DEFAULT_TIMEOUT", "ROLE_ALIAS_PREFIX", "bind_roles", "current_rank",
           "each_rank_in_turn", "leaked_ranks", "run_threaded"]

DEFAULT_TIMEOUT = 120.0
"""Seconds a threaded world may run before ``run_threaded`` gives up on it."""

ROLE_ALIAS_PREFIX = "dcp."
"""``bind_roles(..., aliases=True)`` registers each role's group as ``ROLE_ALIAS_PREFIX + role``."""

# Threads still running this long after they were told to stop are reported as hung.
_STOP_GRACE = 0.5
# The SystemExit message the threaded PG raises in ranks woken by another rank's failure.
_TERMINATED = "Test termination event occurs."

# Longest sleep of a store wait between checks of its key and of the world's stop.
_POLL = 0.01
# Seconds the interpreter waits at exit for leaked rank threads before naming them.
_EXIT_GRACE = 2.0

_world_lock = threading.Lock()
# (world number, rank, thread) of every rank thread that outlived its world's stop.
_leaked: list[tuple[int, int, threading.Thread]] = []
_worlds_started = [0]
# Guards which world may raise the threaded PG's (class-wide) termination event: a rank
# thread left behind by an earlier world must not stop the collectives of the current one.
_live_lock = threading.Lock()
_live_world: list[object | None] = [None]
_serial_lock = threading.Lock()
_tls = threading.local()


class _WorldStopped(BaseException):
    """Ends a rank's wait in the world's store once the world has stopped (a BaseException,
    so that torch's store barrier, which retries on RuntimeError, lets it through)."""


class _WorldStore(dist.Store):
    """The store of one threaded world: a HashStore whose ``wait`` polls, so that it ends
    (with :class:`_WorldStopped`) as soon as the world stops instead of sleeping in C++."""

    def __init__(self) -> None:
        super().__init__()
        self._store = dist.HashStore()
        self.stopped = threading.Event()

    def set(self, key, value):
        self._store.set(key, value)

    def get(self, key):
        return self._store.get(key)

    def add(self, key, amount):
        return self._store.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._store.compare_set(key, expected, desired)

    def check(self, keys):
        return self._store.check(keys)

    def delete_key(self, key):
        return self._store.delete_key(key)

    def num_keys(self):
        return self._store.num_keys()

    def set_timeout(self, timeout):
        self._store.set_timeout(timeout)

    def wait(self, keys, timeout=None):
        limit = (timeout if timeout is not None else self._store.timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.0005
        while not self._store.check(keys):
            if self.stopped.is_set():
                raise _WorldStopped(_TERMINATED)
            if time.monotonic() >= deadline:
                # What the C++ stores raise: torch's barrier catches it and retries.
                raise RuntimeError(f"Wait timeout after {limit} s for keys {keys}")
            self.stopped.wait(pause)
            pause = min(2 * pause, _POLL)


def leaked_ranks() -> list[tuple[int, int]]:
    """``(world number, rank)`` of rank threads that outlived their world's stop and are
    still running (worlds are numbered from 1 in the order they started)."""
    return [(w, r) for w, r, t in _leaked if t.is_alive()]


def _join_leaked_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_GRACE
    for _, _, t in _leaked:
        t.join(max(0.0, deadline - time.monotonic()))
    still = leaked_ranks()
    if still:
        print(f"dcp_compile: threaded-world rank threads still running at exit "
              f"(world, rank): {still}. They timed out and could not be stopped; as daemon "
              "threads they end with the process.", file=sys.stderr)


atexit.register(_join_leaked_at_exit)


def each_rank_in_turn(fn: Callable[..., Any], *args: Any) -> Any:
    """Collective: run ``fn(*args)`` on one rank thread at a time, then wait (a barrier on
    the default group) until every rank has; returns ``fn``'s result on this rank.

    For tracing inside a threaded world: ``fx.symbolic_trace`` patches
    ``torch.nn.Module.__call__`` process-wide while it traces, so a rank calling any module
    (a GraphModule included) while another rank traces fails with "module is not installed as
    a submodule". ``gm = each_rank_in_turn(fx.symbolic_trace, module)`` is safe; so is tracing
    once before the world (with ``bind_roles(..., aliases=True)`` one graph serves all ranks).
    ``fn`` must not issue collectives: the other ranks cannot reach them while it runs.
    """
    with _serial_lock:
        out = fn(*args)
    dist.barrier()
    return out


def current_rank() -> int | None:
    """The rank of the threaded-world thread calling this, or None outside a threaded world."""
    return getattr(_tls, "rank", None)


def run_threaded(world_size: int, fn: Callable[..., Any], *args: Any,
                 timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` threads with a threaded process group.

    Each thread initialises the default group (``backend="threaded"``, rank ``rank``), runs
    ``fn`` and destroys every group it created. Returns the ranks' results in rank order.
    The caller's grad mode (``torch.no_grad()``) applies in the rank threads. The CPU random
    generator is shared by all threads: draw random inputs before the call, or per rank from
    a ``torch.Generator`` seeded with the rank.

    If any rank raises, the others are woken out of their collectives (the threaded PG's
    termination event) and :class:`DCPWorldError` is raised from the first failing rank's
    exception, naming that rank and carrying every failing rank's traceback in ``failures``.
    If the world has not finished after ``timeout`` seconds, the same error lists the hung
    ranks in ``timed_out`` with the stack each is stuck in, and the world is stopped: ranks in
    a collective or a group creation end. A rank stuck elsewhere (pure Python, a long op)
    cannot be stopped: the error names it first (``leaked``: it stopped answering, the others
    were its victims), and it is left running as a daemon thread, listed by
    :func:`leaked_ranks` until it ends.
    """
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg)

    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be a positive int: world_size={world_size!r}. "
                         "Pass the number of ranks, e.g. topology.tp.")
    if current_rank() is not None:
        raise DCPWorldError(
            f"run_threaded called from rank {current_rank()} of a running threaded world. "
            "Nested threaded worlds are not supported; run them one after the other.")
    if not _world_lock.acquire(timeout=timeout):
        raise DCPWorldError(f"another threaded world is still running after {timeout} s. "
                            "Only one threaded world runs at a time per process.",
                            timed_out=list(range(world_size)))
    try:
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        world = _install_threaded_pg()
        ProcessLocalGroup.reset()
        store = _WorldStore()
        _worlds_started[0] += 1
        world_number = _worlds_started[0]
        pg_timeout = timedelta(seconds=timeout)
        results: list[Any] = [None] * world_size
        raised: dict[int, BaseException] = {}
        grad_enabled = torch.is_grad_enabled()  # thread-local in torch: carry it over
        token = object()
        _live_world[0] = token

        def stop_world(exc: BaseException) -> None:
            store.stopped.set()  # ranks waiting in a group creation
            with _live_lock:
                if _live_world[0] is token:
                    ProcessLocalGroup.exception_handle(exc)  # wake ranks in collectives

        def rank_main(rank: int) -> None:
            _tls.rank, _tls.timeout = rank, pg_timeout
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size,
                                        store=store, timeout=pg_timeout)
                with torch.set_grad_enabled(grad_enabled):
                    results[rank] = fn(rank, *args)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                raised[rank] = exc
                stop_world(exc)
            finally:
                try:
                    if dist.distributed_c10d._world is world and dist.is_initialized():
                        dist.destroy_process_group()
                except BaseException as exc:  # noqa: BLE001
                    raised.setdefault(rank, exc)
                _tls.rank = _tls.timeout = None

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"dcp-rank-{r}",
                                    daemon=True) for r in range(world_size)]
        deadline = time.monotonic() + timeout
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung: dict[int, str] = {}
        if any(t.is_alive() for t in threads):
            frames = sys._current_frames()
            hung = {r: "".join(traceback.format_stack(frames[t.ident]))
                    if t.ident in frames else "(no stack)\n"
                    for r, t in enumerate(threads) if t.is_alive()}
            stop_world(TimeoutError("threaded world timed out"))
            stop = time.monotonic() + _STOP_GRACE
            for t in threads:
                t.join(max(0.0, stop - time.monotonic()))
        leaked = [r for r, t in enumerate(threads) if t.is_alive()]
        _leaked[:] = [x for x in _leaked if x[2].is_alive()]
        _leaked.extend((world_number, r, threads[r]) for r in leaked)
    finally:
        with _live_lock:
            _live_world[0] = None
            ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _world_lock.release()

    _raise_failures(world_size, dict(raised), hung, leaked, timeout)
    return results


def _is_termination(exc: BaseException) -> bool:
    return (isinstance(exc, _WorldStopped)
            or isinstance(exc, SystemExit) and str(exc.code) == _TERMINATED)


def _raise_failures(world_size: int, raised: dict[int, BaseException], hung: dict[int, str],
                    leaked: list[int], timeout: float) -> None:
    """One DCPWorldError naming the culprits first: ranks that raised, else ranks that could
    not be stopped (hung outside any collective); then the ranks stopped because of them."""
    if not raised and not hung:
        return
    failures = {r: "".join(traceback.format_exception(e)) for r, e in sorted(raised.items())}
    for r, stack in hung.items():
        failures[r] = f"rank {r} still running after {timeout} s; stuck at:\n{stack}"
    primary = sorted(r for r, e in raised.items() if not _is_termination(e))
    stopped = sorted(r for r, e in raised.items() if _is_termination(e) and r not in leaked)
    finished = sorted(set(range(world_size)) - set(raised) - set(hung))
    exc = raised[primary[0]] if primary else None
    if primary:
        r0 = primary[0]
        head = (f"rank {r0} of {world_size} raised {type(exc).__name__}: {exc}"
                if len(primary) == 1 else
                f"ranks {primary} of {world_size} raised; first, rank {r0}: "
                f"{type(exc).__name__}: {exc}")
    else:
        head = f"threaded world of {world_size} ranks did not finish in {timeout} s"
    lines = [head + "."]
    if leaked:
        lines.append(f"Rank{'s' if len(leaked) > 1 else ''} {leaked} stopped answering: "
                     f"still running {timeout} s after the start, outside any collective, and "
                     f"could not be stopped; left running as daemon threads (see "
                     f"dcp_compile.runtime.distributed.world.leaked_ranks()), they cannot touch later worlds.")
    elif hung:
        lines.append(f"Ranks still running after {timeout} s: {sorted(hung)}, each blocked in "
                     "a collective or a group creation"
                     + (f" that ranks {finished} (which returned) never issued"
                        if finished else "")
                     + ": the ranks issued different collectives or a member never reached it.")
    if stopped:
        lines.append(f"Ranks {stopped} were stopped in a collective because of it.")
    for r in primary + sorted(leaked or hung):
        lines.append(f"--- rank {r} ---\n{failures[r].rstrip()}")
    raise DCPWorldError("\n".join(lines), failures=failures, timed_out=sorted(hung),
                        leaked=leaked) from exc


def bind_roles(topology: Topology, rank: int, *, aliases: bool = False,
               timeout: float | None = None) -> dict[str, str]:
    """Create the process groups of every role of ``topology``; return role -> group name.

    Collective: every rank of the initialised world must call it, with the same topology.
    For each role in ``topology.groups`` order, for each of its groups in order, every rank
    calls ``dist.new_group`` (so group names agree across ranks); the result for each role is
    ``pg.group_name`` of the group holding ``rank`` — the ``group_name`` argument of
    ``torch.ops._c10d_functional.*``. Those names differ between ranks of different groups
    of one role (rank 0's ``cp_kv`` group is not rank 1's), so a graph holding them is per rank.

    With ``aliases=True`` each rank also registers its group of each role under the same
    name on every rank, ``"dcp." + role`` (the group registry is per process, and per thread
    in a threaded world), and returns those names instead: one graph, traced or built once,
    then runs unchanged on every rank. Re-binding replaces earlier aliases.

    A rank list seen twice (two roles with the same groups, e.g. decode with dcp == tp) reuses
    one group; a group of all ranks is the default group. Size-1 groups are real groups: every
    collective on them works (a copy). Each call creates new groups, so bind a topology once
    per world.

    ``timeout`` (seconds) bounds the creation of each group and every collective on it; by
    default the ``run_threaded`` timeout in a threaded world, else torch's backend default.
    """
    if not dist.is_initialized():
        raise DCPWorldError("bind_roles needs an initialised process group: none is. "
                            "Call it inside run_threaded, or after "
                            "dcp_compile.runtime.distributed.launch.init_distributed_from_env().")
    world_size, world_rank = dist.get_world_size(), dist.get_rank()
    if world_size != topology.tp:
        raise DCPWorldError(f"world size does not match the topology: world_size={world_size},"
                            f" topology.tp={topology.tp}. Launch tp={topology.tp} ranks.")
    if rank != world_rank:
        raise DCPWorldError(f"rank does not match this process's rank in the world: "
                            f"rank={rank}, dist.get_rank()={world_rank}. Pass the rank the "
                            "world gave this rank.")
    if timeout is not None:
        pg_timeout = timedelta(seconds=timeout)
    else:
        pg_timeout = getattr(_tls, "timeout", None)
    everyone = tuple(range(world_size))
    made: dict[tuple[int, ...], Any] = {everyone: dist.group.WORLD}
    mine: dict[str, Any] = {}
    for role, groups in topology.groups.items():
        for ranks in groups:
            key = tuple(ranks)
            if list(key) != sorted(key):
                # new_group orders members by global rank; gathers follow that order.
                raise DCPWorldError(f"a group of role {role!r} is not in ascending rank order:"
                                    f" {list(key)}. List each group's ranks ascending.")
            if key not in made:
                made[key] = dist.new_group(list(ranks), timeout=pg_timeout)
            if rank in ranks:
                mine[role] = made[key]
        if role not in mine:
            raise DCPWorldError(f"rank {rank} is in no group of role {role!r}: "
                                f"groups={groups}. Roles must partition range({world_size}).")
    if not aliases:
        return {role: pg.group_name for role, pg in mine.items()}
    from torch._C._distributed_c10d import (_register_process_group,
                                            _resolve_process_group,
                                            _unregister_process_group)
    names = {}
    for role, pg in mine.items():
        alias = ROLE_ALIAS_PREFIX + role
        try:
            _resolve_process_group(alias)
        except RuntimeError:
            pass
        else:
            _unregister_process_group(alias)
        _register_process_group(alias, pg)
        names[role] = alias
    return names

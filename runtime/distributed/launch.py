"""torchrun + gloo on this machine: real processes, real collectives, loopback only.

A worker module calls :func:`init_distributed_from_env` (torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), then ``dcp_compile.runtime.distributed.world.bind_roles`` and runs its program. The
launching side builds the command with :func:`torchrun_command` or runs it with
:func:`run_torchrun`, which raises :class:`DCPWorldError` with the output of the failing ranks.

Hangs: a rank that stops answering makes its peers wait in a collective until the
collective's timeout, and torchrun then reports the peer that gave up first ("rank 0
failed"). So under :func:`run_torchrun` every rank dumps its Python stacks when it is
terminated (``faulthandler`` on SIGTERM, set up by :func:`init_distributed_from_env`): a rank
killed outside any ``torch.distributed`` call is the one that stopped answering, and the
error names it first; ranks that timed out or were killed inside a collective are its victims.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import ipaddress
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Sequence

from dcp_compile.runtime.errors import DCPWorldError

__all__ = ["ephemeral_port_start", "free_port", "free_port_base", "freeze_gc", "init_distributed_from_env", "loopback_env", "rank_state",
           "loopback_interface", "rank_process_env", "run_in_world", "run_torchrun", "torchrun_command"]

LOOPBACK = "127.0.0.1"
# The directory holding the dcp_compile, passes and runtime packages.
_SOURCE_ROOT = Path(__file__).resolve().parents[2]
# Lines of each failing rank's output quoted in an error.
_TAIL_LINES = 60
# Set by run_torchrun: the directory where each rank dumps its stacks when terminated.
STACK_DIR_ENV = "DCP_STACK_DIR"
_stack_file = []  # the open dump file of this rank (faulthandler writes to its descriptor)


def loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if name in ("lo", "lo0"):
            return name
    return next((n for n in names if n.startswith("lo")), None)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def init_distributed_from_env(*, timeout: float = 120.0) -> tuple[int, int]:
    """Initialise the default gloo process group from torchrun's environment, on loopback.

    Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; MASTER_ADDR must be a loopback
    address. Gloo is pinned to the loopback interface (``GLOO_SOCKET_IFNAME``, unless already
    set). ``timeout`` (seconds) bounds every collective. Returns ``(rank, world_size)``; call
    ``torch.distributed.destroy_process_group()`` when done: it frees the default group, so
    no gloo thread outlives it into interpreter shutdown.
    """
    import torch.distributed as dist

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise DCPWorldError(f"torchrun environment variables missing: {missing}. Launch with "
                            "dcp_compile.runtime.distributed.launch.run_torchrun or `torchrun --nproc-per-node N`.")
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise DCPWorldError(f"RANK and WORLD_SIZE must be integers: RANK="
                            f"{os.environ['RANK']!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r}. "
                            "Launch with torchrun.") from None
    addr = os.environ["MASTER_ADDR"]
    if not _is_loopback(addr):
        raise DCPWorldError(f"MASTER_ADDR is not a loopback address: MASTER_ADDR={addr!r}. "
                            f"This world runs on one machine; use --master-addr {LOOPBACK}.")
    if dist.is_initialized():
        raise DCPWorldError("the default process group is already initialised in this "
                            f"process: rank={dist.get_rank()}. Initialise once per process.")
    iface = loopback_interface()
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    # torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when it is
    # imported, and torch._dynamo imports it (a transform, a program's first step,
    # torch.compile). Imported after init_process_group, it keeps the default gloo group --
    # and its three C++ threads -- alive past destroy_process_group into interpreter
    # shutdown. Imported first, it binds None.
    import torch.distributed.nn  # noqa: F401
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    _dump_stacks_when_terminated(rank)
    return rank, world_size


# The cyclic collector's thresholds in a worker: the young generation every 10^4 net
# allocations instead of 700 (tests/conftest.py sets the same for the test processes).
GC_THRESHOLDS = (10_000, 50, 100)


def freeze_gc() -> None:
    """Keep the objects alive now (a worker's imports: torch, sympy, transformers...) out of
    the cyclic garbage collector's scans, for the rest of the process and at exit, and
    collect the young generation less often (``GC_THRESHOLDS``).

    A rank's compile allocates ~10^5 short-lived objects (fake tensors, nodes): each young
    collection walked them, each full one rescanned every import (~9% of a rank's compile
    and decode), and interpreter shutdown collects once more over everything (~0.7 of the
    ~3.5 CPU-s a torch process spends starting and stopping). Call it once the imports are
    done; garbage made later is still collected.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    atexit.register(gc.freeze)   # at exit: what the process built since, too


def run_in_world(part, *, timeout: float = 120.0):
    """A worker's life in the world torchrun started: initialise it, freeze the collector
    (``freeze_gc``), run ``part(rank, world_size)``, and destroy the process group whatever
    happens; returns what ``part`` returns."""
    import torch.distributed as dist
    rank, world = init_distributed_from_env(timeout=timeout)
    freeze_gc()
    try:
        return part(rank, world)
    finally:
        dist.destroy_process_group()


def _dump_stacks_when_terminated(rank: int) -> None:
    """Under run_torchrun, write this rank's Python stacks to ``$DCP_STACK_DIR/rank<r>.txt``
    when SIGTERM arrives (then terminate as before): the launcher reads where it was."""
    stack_dir = os.environ.get(STACK_DIR_ENV)
    if not stack_dir or _stack_file:
        return
    f = open(Path(stack_dir) / f"rank{rank}.txt", "w")  # noqa: SIM115 - open for the process
    _stack_file.append(f)
    faulthandler.register(signal.SIGTERM, file=f, all_threads=True, chain=True)


def torchrun_command(nproc: int, module: str, args: Sequence[str] = (), *,
                     master_port: int | None = None,
                     log_dir: str | os.PathLike | None = None) -> list[str]:
    """``python -m torch.distributed.run`` for ``nproc`` local ranks running ``-m module``.

    Picks a free port on 127.0.0.1 unless ``master_port`` is given. With ``log_dir``, every
    rank's stdout and stderr are also written under it (``--log-dir DIR --tee 3``) and echoed
    with a ``[default<rank>]:`` prefix.
    """
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"nproc must be a positive int: nproc={nproc!r}. Pass the number of "
                         "ranks, e.g. topology.tp.")
    port = free_port() if master_port is None else int(master_port)
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", LOOPBACK, "--master-port", str(port),
           "--max-restarts", "0"]
    if log_dir is not None:
        cmd += ["--log-dir", os.fspath(log_dir), "--tee", "3"]
    return cmd + ["-m", module, *map(str, args)]


def rank_process_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a rank process this machine launches: this one's, with this source
    tree first on PYTHONPATH, ``OMP_NUM_THREADS=1``, unbuffered output and the loopback
    ``GLOO_SOCKET_IFNAME`` (unless the environment sets them), then ``env``."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_SOURCE_ROOT), child_env.get("PYTHONPATH")) if p)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    iface = loopback_interface()
    if iface is not None:
        child_env.setdefault("GLOO_SOCKET_IFNAME", iface)
    child_env.update(env or {})
    return child_env


def run_torchrun(nproc: int, module: str, args: Sequence[str] = (), *,
                 timeout: float = 300.0, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``module`` on ``nproc`` gloo ranks with torchrun; return the completed process.

    The children see this source tree on PYTHONPATH, ``OMP_NUM_THREADS=1`` and the loopback
    ``GLOO_SOCKET_IFNAME`` (unless ``env`` or the environment sets them). On a non-zero exit
    or after ``timeout`` seconds (the whole launch is then killed), raises
    :class:`DCPWorldError` whose ``failures`` map each failing rank to the tail of its output.
    A port taken between choosing it and binding it is retried once with a new port.
    """
    child_env = rank_process_env(env)
    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="dcp-torchrun-") as tmp:
            log_dir, stack_dir = Path(tmp) / "logs", Path(tmp) / "stacks"
            stack_dir.mkdir()
            cmd = torchrun_command(nproc, module, args, log_dir=log_dir)
            proc, timed_out = _run(cmd, {**child_env, STACK_DIR_ENV: str(stack_dir)}, cwd,
                                   timeout)
            if proc.returncode == 0 and not timed_out:
                return proc
            logs, stacks = _rank_logs(log_dir), _rank_stacks(stack_dir)
        if (attempt == 0 and not timed_out
                and re.search(r"EADDRINUSE|[Aa]ddress already in use", proc.stdout + proc.stderr)):
            continue
        raise _launch_error(nproc, module, proc, logs, timed_out, timeout, stacks)
    raise AssertionError("unreachable")


def _run(cmd: list[str], env: dict[str, str], cwd, timeout: float):
    # A session of its own, so that a timeout kills torchrun and every rank it started.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=cwd, start_new_session=True)
    timed_out = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out, out, err = True, "", ""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                out, err = p.communicate(timeout=5.0)
                break
            except subprocess.TimeoutExpired:
                continue
    return subprocess.CompletedProcess(cmd, p.returncode, out or "", err or ""), timed_out


def _rank_logs(log_dir: Path) -> dict[int, str]:
    """Each local rank's stderr then stdout, from torchrun's ``<log_dir>/**/attempt_0/<r>/``."""
    logs: dict[int, str] = {}
    for rank_dir in sorted(log_dir.glob("*/attempt_*/*")):
        if not rank_dir.name.isdigit():
            continue
        parts = []
        for stream in ("stderr.log", "stdout.log"):
            f = rank_dir / stream
            if f.exists():
                text = f.read_text(errors="replace").strip()
                if text:
                    parts.append(f"[{stream}]\n{text}")
        logs[int(rank_dir.name)] = "\n".join(parts)
    return logs


_RANK_EXIT = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
# What a gloo rank says when a peer process died under it.
_PEER_DIED = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash")
# What a gloo rank says when its collective's timeout passed with a peer not answering.
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms for \w+ operation|[Tt]imed out.*(gloo|recv|"
                        r"send)")
# A frame in a Python traceback / a faulthandler dump.
_TB_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_FH_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
# torch.distributed frames that are wrappers, not the call a rank is blocked in.
_WRAPPERS = ("wrapper", "_wrapper", "inner")


def _rank_stacks(stack_dir: Path) -> dict[int, str]:
    """Each rank's faulthandler dump (written when it was terminated), if any."""
    stacks = {}
    for f in stack_dir.glob("rank*.txt"):
        text = f.read_text(errors="replace").strip()
        if text and f.stem[4:].isdigit():
            stacks[int(f.stem[4:])] = text
    return stacks


def _collective_of(frames: list[tuple[str, str, str]]) -> str | None:
    """The innermost torch.distributed call among ``frames`` (innermost first), if any."""
    for path, _, func in frames:
        if "torch/distributed/" in path.replace(os.sep, "/") and func not in _WRAPPERS:
            return func
    return None


def _main_thread_frames(dump: str) -> list[tuple[str, str, str]]:
    """Frames (innermost first) of the main thread in a faulthandler dump: the thread whose
    outermost frame runs the module (``_run_module_as_main`` / ``<module>``)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    parsed = [_FH_FRAME.findall(b) for b in blocks]
    for frames in parsed:
        if frames and frames[-1][2] in ("_run_module_as_main", "<module>"):
            return frames
    return next((f for f in parsed if f), [])


def _where(frames: list[tuple[str, str, str]]) -> str:
    path, line, func = frames[0]
    return f"{Path(path).name}:{line} in {func}"


def rank_state(code: int | None, log: str, stack: str | None) -> tuple[str, str]:
    """``(kind, where)`` of a rank that did not finish: kind "error" (it raised on its own),
    "waiting" (timed out, killed or dropped inside a collective: a victim), "hung" (killed
    outside any collective: it stopped answering) or "unknown"."""
    if code is not None and code > 0:
        tb = _TB_FRAME.findall(log)[::-1]
        coll = _collective_of(tb)
        if _TIMED_OUT.search(log) and coll:
            return "waiting", f"timed out in {coll}"
        if _PEER_DIED.search(log):
            return "waiting", f"peer gone during {coll or 'a collective'}"
        return "error", ""
    if stack:
        frames = _main_thread_frames(stack)
        coll = _collective_of(frames)
        if coll:
            return "waiting", f"killed in {coll}"
        if frames:
            return "hung", _where(frames)
    if _PEER_DIED.search(log):
        return "waiting", "peer gone"
    return "unknown", ""


def _failed_ranks(torchrun_output: str) -> tuple[dict[int, int], int | None]:
    """rank -> exit code from torchrun's failure summary, and its "Root Cause" rank."""
    codes = {int(r): int(c) for r, c in _RANK_EXIT.findall(torchrun_output)}
    _, _, root = torchrun_output.partition("Root Cause")
    found = _RANK_EXIT.search(root)
    return codes, int(found.group(1)) if found else None


def _tail(text: str, n: int = _TAIL_LINES) -> str:
    lines = text.splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def _launch_error(nproc, module, proc, logs, timed_out, timeout, stacks=None) -> DCPWorldError:
    """The culprits first: ranks that raised on their own, else ranks that stopped answering
    (terminated outside any collective); then the ranks that waited for them."""
    stacks = stacks or {}
    combined = proc.stdout + proc.stderr
    codes, root = _failed_ranks(combined)
    ranks = sorted(set(codes) | set(logs) | set(stacks)) if timed_out else \
        (sorted(codes) or sorted(logs))
    states = {r: rank_state(None if timed_out else codes.get(r), logs.get(r, ""),
                             stacks.get(r)) for r in ranks}
    errors = [r for r in ranks if states[r][0] == "error"]
    hung = [r for r in ranks if states[r][0] == "hung"]
    waiting = [r for r in ranks if states[r][0] == "waiting"]
    if timed_out:
        head = (f"torchrun of {module} on {nproc} ranks did not finish in {timeout} s and was "
                "killed")
    else:
        head = f"torchrun of {module} on {nproc} ranks failed (exit code {proc.returncode})"
    if errors:
        causes = errors
        head += f": rank{'s' if len(causes) > 1 else ''} {', '.join(map(str, causes))} failed"
    elif hung:
        causes = hung
        head += (f": rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} stopped "
                 "answering (" + "; ".join(f"rank {r} at {states[r][1]}" for r in hung)
                 + ", outside any collective)")
    elif waiting:
        causes = waiting
        head += (": every failing rank was waiting in a collective ("
                 + "; ".join(f"rank {r} {states[r][1]}" for r in waiting)
                 + "): the ranks issued different collectives, or a rank returned early")
        waiting = []
    else:
        causes = [root] if root is not None and root in ranks else ranks
    collateral = [r for r in ranks if r not in causes]
    if collateral and (errors or hung):
        victims = [f"rank {r} {states[r][1]}" if states[r][0] == "waiting" else f"rank {r}"
                   for r in collateral]
        head += f"; ranks {collateral} stopped after it (" + "; ".join(victims) + ")"
    elif collateral:
        head += f"; ranks {collateral} stopped after it (peer gone or killed)"
    if codes and not timed_out:
        head += f"; exit codes {dict(sorted(codes.items()))}"
    failures = {}
    for r in causes + collateral:
        text = _tail(logs.get(r, ""))
        if r in stacks and states[r][0] in ("hung", "waiting", "unknown"):
            text += f"\n[stacks when terminated]\n{_tail(stacks[r])}"
        failures[r] = text.strip() or "(no output)"
    lines = [head + "."]
    for r in causes:
        lines.append(f"--- rank {r} ---\n{failures[r]}")
    if not any(logs.values()):
        lines.append(f"--- torchrun output ---\n{_tail(combined)}")
    lines.append("command: " + " ".join(proc.args))
    return DCPWorldError("\n".join(lines), failures=failures,
                         timed_out=ranks if timed_out else ())


def ephemeral_port_start(default: int = 32768) -> int:
    """The first port of the kernel's ephemeral range (Linux: ip_local_port_range).

    Outgoing connections (UCX between engines, gloo, torchrun's store) take ports of that range
    at any moment, so a port chosen free there can be gone when a later scenario binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _free_port_base(n: int, lo: int = 20000, hi: int | None = None) -> int:
    """A base port with n consecutive free ports on 127.0.0.1, below the ephemeral range
    (``hi``, default :func:`ephemeral_port_start`)."""
    hi = ephemeral_port_start() if hi is None else hi
    if hi - n <= lo:
        raise DCPWorldError(f"no room for {n} ports in [{lo}, {hi}) below the ephemeral "
                               f"range. Raise the start of net.ipv4.ip_local_port_range or use "
                               f"fewer ports.")
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise DCPWorldError(f"no {n} consecutive free ports on 127.0.0.1 in [{lo}, {hi}) after 200 tries. Stop the processes holding them or retry.")


def free_port_base(n: int) -> int:
    return _free_port_base(n)


def loopback_env(env: dict | None = None) -> dict:
    """Environment for engine processes: UCX over tcp on loopback, quiet NIXL, one thread."""
    env = dict(os.environ if env is None else env)
    env.update({"UCX_TLS": env.get("UCX_TLS", "tcp,self,sm"), "UCX_NET_DEVICES": "lo",
                "NIXL_LOG_LEVEL": env.get("NIXL_LOG_LEVEL", "WARN"), "OMP_NUM_THREADS": "1"})
    return env

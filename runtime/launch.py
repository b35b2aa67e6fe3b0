"""torchrun + gloo on this machine: real processes, real collectives, loopback only.

A worker module calls :func:`init_distributed_from_env` (torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), then ``runtime.world.bind_roles`` and runs its program. The
launching side builds the command with :func:`torchrun_command` or runs it with
:func:`run_torchrun`, which raises :class:`DCPWorldError` with the output of the failing ranks.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Sequence

from dcp_compile.errors import DCPWorldError

__all__ = ["free_port", "init_distributed_from_env", "loopback_interface", "run_torchrun",
           "torchrun_command"]

LOOPBACK = "127.0.0.1"
# The directory holding the dcp_compile, passes and runtime packages.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
# Lines of each failing rank's output quoted in an error.
_TAIL_LINES = 60


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
    ``torch.distributed.destroy_process_group()`` when done.
    """
    import torch.distributed as dist

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise DCPWorldError(f"torchrun environment variables missing: {missing}. Launch with "
                            "runtime.launch.run_torchrun or `torchrun --nproc-per-node N`.")
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
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    return rank, world_size


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
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_SOURCE_ROOT), child_env.get("PYTHONPATH")) if p)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    iface = loopback_interface()
    if iface is not None:
        child_env.setdefault("GLOO_SOCKET_IFNAME", iface)
    child_env.update(env or {})
    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="dcp-torchrun-") as log_dir:
            cmd = torchrun_command(nproc, module, args, log_dir=log_dir)
            proc, timed_out = _run(cmd, child_env, cwd, timeout)
            if proc.returncode == 0 and not timed_out:
                return proc
            logs = _rank_logs(Path(log_dir))
        if (attempt == 0 and not timed_out
                and re.search(r"EADDRINUSE|[Aa]ddress already in use", proc.stdout + proc.stderr)):
            continue
        raise _launch_error(nproc, module, proc, logs, timed_out, timeout)
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


def _failed_ranks(torchrun_output: str) -> tuple[dict[int, int], int | None]:
    """rank -> exit code from torchrun's failure summary, and its "Root Cause" rank."""
    codes = {int(r): int(c) for r, c in _RANK_EXIT.findall(torchrun_output)}
    _, _, root = torchrun_output.partition("Root Cause")
    found = _RANK_EXIT.search(root)
    return codes, int(found.group(1)) if found else None


def _tail(text: str, n: int = _TAIL_LINES) -> str:
    lines = text.splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def _launch_error(nproc, module, proc, logs, timed_out, timeout) -> DCPWorldError:
    combined = proc.stdout + proc.stderr
    codes, root = _failed_ranks(combined)
    if timed_out:
        head = (f"torchrun of {module} on {nproc} ranks did not finish in {timeout} s and was "
                "killed")
        causes, collateral = sorted(logs), []
    else:
        # Once one rank dies, its peers fail in their next collective ("Connection closed by
        # peer") or are killed by torchrun (negative exit code): those are collateral.
        failed = sorted(codes) or sorted(logs)
        collateral = [r for r in failed
                      if codes.get(r, 1) < 0 or _PEER_DIED.search(logs.get(r, ""))]
        causes = [r for r in failed if r not in collateral]
        if not causes:
            causes = [root] if root is not None else failed
            collateral = [r for r in collateral if r not in causes]
        head = (f"torchrun of {module} on {nproc} ranks failed (exit code {proc.returncode}): "
                f"rank{'s' if len(causes) > 1 else ''} {', '.join(map(str, causes))} failed")
        if collateral:
            head += f"; ranks {collateral} stopped after it (peer gone or killed)"
        if codes:
            head += f"; exit codes {dict(sorted(codes.items()))}"
    failures = {r: _tail(logs.get(r, "")) or "(no output)" for r in causes + collateral}
    lines = [head + "."]
    for r in causes:
        lines.append(f"--- rank {r} ---\n{failures[r]}")
    if not any(logs.values()):
        lines.append(f"--- torchrun output ---\n{_tail(combined)}")
    lines.append("command: " + " ".join(proc.args))
    return DCPWorldError("\n".join(lines), failures=failures,
                         timed_out=sorted(logs) if timed_out else ())

"""One rank's NIXL agent: the UCX environment, the agent, and its caches registered as DRAM.

UCX reads its settings when the first agent is created: unless already set,
``UCX_TLS=tcp,self,sm`` and, for a loopback side channel, ``UCX_NET_DEVICES=lo`` (so UCX does
not advertise other interfaces). On CPU ``UCX_TLS`` must include ``tcp``. Agents run without
NIXL's progress thread by default (it busy-polls a core per agent, too much for a few cores).
nixl itself is imported only when an agent is made.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch

from dcp_compile.runtime.errors import DCPTransferError

__all__ = ["LOOPBACK_HOSTS", "POLL_SLEEP", "RankAgent", "configure_ucx_env"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
POLL_SLEEP = 0.0005                  # seconds between polls of an agent
_DRAIN_SECONDS = 0.5                 # progress after a failed transfer, before teardown


def configure_ucx_env(host: str = "127.0.0.1") -> None:
    """Defaults for UCX on CPU: tcp (+ self, sm); loopback only when the host is loopback."""
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    if host in LOOPBACK_HOSTS:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    tls = os.environ["UCX_TLS"]
    if "tcp" not in tls.split(",") and tls not in ("all", "^"):
        raise DCPTransferError(f"UCX_TLS must include tcp for DRAM transfers on CPU: UCX_TLS="
                               f"{tls!r}. Use UCX_TLS=tcp,self,sm.")


def _nixl_api():
    from dcp_compile.runtime.transfer.nixl.build import nixl_api
    try:
        return nixl_api()
    except Exception as e:  # the wheel raises ImportError, or RuntimeError without a backend
        raise DCPTransferError(f"the nixl package is not usable: {type(e).__name__}: {e}. "
                               f"Install it with `pip install -e '.[nixl]'`.") from e


def _make_agent(name: str, host: str, progress_thread: bool):
    configure_ucx_env(host)
    api = _nixl_api()
    try:
        return api.nixl_agent(name, api.nixl_agent_config(
            enable_prog_thread=progress_thread, enable_listen_thread=False, backends=["UCX"]))
    except Exception as e:
        raise DCPTransferError(f"cannot create NIXL agent {name!r}: {type(e).__name__}: {e}. "
                               f"Check that the UCX plugin loads (UCX_TLS="
                               f"{os.environ.get('UCX_TLS')!r}).") from e


class RankAgent:
    """One rank's NIXL agent with its caches registered as DRAM."""

    def __init__(self, name: str, caches: list[torch.Tensor], host: str, progress_thread: bool,
                 extra: Sequence[torch.Tensor] = ()):
        self.name = name
        self.caches = caches
        self.peer_failed = False  # a transfer failed: drain before the agent is destroyed
        # Landing place of the handshake's connection probe (never a cache row).
        self.scratch = torch.zeros(64, dtype=torch.uint8)
        self.agent = _make_agent(name, host, progress_thread)
        try:
            self._reg = self.agent.register_memory(caches + [self.scratch, *extra])
        except Exception as e:
            raise DCPTransferError(f"agent {name}: registering the KV caches as DRAM failed: "
                                   f"{type(e).__name__}: {e}.") from e

    def drain(self, seconds: float = _DRAIN_SECONDS) -> None:
        """Progress the agent for a while. After a peer failed, UCX discards its endpoints
        during progress; destroying the agent before that aborts the process (UCX assertion
        ``ucs_arbiter_group_is_empty``, seen in about 1 of 3 runs after a killed peer)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.agent.get_new_notifs()
            except Exception:
                return
            time.sleep(POLL_SLEEP)

    def close(self):
        if self.peer_failed:
            self.drain()
        reg, self._reg = self._reg, None
        if reg is not None:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass  # tearing down; the agent's destructor releases the rest


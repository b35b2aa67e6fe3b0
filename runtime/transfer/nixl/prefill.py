"""The prefill side of the NIXL KV transfer: a rank that serves its metadata, leases
requests' blocks to their readers and accepts their notifications (spec: "Disaggregated
Inference (NIXL Transfer)": Notification Handling). See :mod:`dcp_compile.runtime.transfer.nixl.connector` for the
whole protocol.

The prefill side is passive: decode ranks READ from it. Without a progress thread a transfer
advances only while both ends poll, so a prefill rank calls :meth:`PrefillKVConnector.poll`
(``wait_for_readers`` does) while decode ranks read.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransferError
from dcp_compile.runtime.names import Mode
from dcp_compile.runtime.topology import topology

from dcp_compile.runtime.transfer.nixl.agent import POLL_SLEEP, RankAgent
from dcp_compile.runtime.transfer.nixl.auth import DCPAuthError, MessageKind, Opener, load_key
from dcp_compile.runtime.transfer.nixl.descriptors import check_caches
from dcp_compile.runtime.transfer.nixl.handshake import (SIDE_CHANNEL_CLIENT_TIMEOUT, NeuronNixlAgentMetadata,
                             SideChannelServer, agent_name)

__all__ = ["NOTIF_STATUSES", "PrefillKVConnector", "RejectedNotification", "notification"]

NOTIF_STATUSES = ("read", "empty")   # a reader read its share / had nothing to read

log = logging.getLogger(__name__)


def notification(request_id: str, epoch: int, engine_id: str, rank: int, status: str) -> bytes:
    """What decode rank ``rank`` of ``engine_id`` sends once per request and remote rank
    (parsed by :meth:`PrefillKVConnector.poll`)."""
    return json.dumps({"req": request_id, "epoch": epoch, "engine": engine_id, "rank": rank,
                       "status": status}).encode()


@dataclass(frozen=True)
class RejectedNotification:
    """A notification the prefill side ignored: who sent it, what it claimed, and why."""

    sender: str                 # the sending agent's name, as NIXL reports it
    request_id: str | None      # what the payload claimed (None: unreadable)
    reason: str
    message: bytes              # the payload's first 256 bytes


@dataclass
class _Lease:
    """A request's blocks, held for its planned readers (see PrefillKVConnector.hold)."""

    request_id: str
    epoch: int
    blocks: tuple[int, ...]
    readers: dict               # (decode engine id, decode rank) -> expected agent name
    deadline: float
    timeout: float
    notified: dict = field(default_factory=dict)  # (engine, rank) -> "read" | "empty"
    outcome: str = "held"       # -> "read" (all readers notified) | "expired" | "released"


class PrefillKVConnector:
    """A prefill rank: registers its caches, serves its metadata, holds requests' blocks for
    their readers and accepts their notifications.

    Blocks are leased per request (:meth:`hold`): a lease names the blocks, the readers the
    transfer plan names (decode engine id, decode rank) and a deadline, and gets an *epoch*
    that the decode side's :class:`TransferRequest` carries. The lease ends when every reader
    has notified (outcome ``"read"``), at its deadline (``"expired"``) or by :meth:`release`;
    only then are blocks no other lease holds freed and handed to ``on_free(request_id,
    blocks)`` for reuse. Block epochs live in a registered int64 array (``epochs[b]``: the
    epoch of the lease that acquired block ``b`` while it is held; minus the free stamp once
    it is freed; 0 if never held). Epochs and free stamps come from one increasing counter, so
    a decode rank that reads ``epochs[b]`` after its data and finds ``0 < epochs[b] <= epoch``
    knows the block was held, never freed, from the lease's start until its data was read.
    """

    def __init__(self, config: DCPConfig, rank: int,
                 kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                 engine_id: str = "prefill", host: str = "127.0.0.1",
                 side_channel_port: int, progress_thread: bool = False,
                 on_free=None, side_channel_client_timeout: float = SIDE_CHANNEL_CLIENT_TIMEOUT,
                 key=None, insecure: bool = False):
        # Refused before anything is registered or listens (auth.load_key: no key, no start).
        self.key = load_key(key, insecure=insecure, who=f"prefill rank {rank}")
        self._opener = Opener(self.key)
        if config.mode != Mode.PREFILL:
            raise DCPTransferError(f"PrefillKVConnector needs the prefill engine's config: "
                                   f"mode={config.mode!r}. Pass DCPConfig(..., mode='prefill').")
        topo = topology(config.tp, config.dcp, config.mode, config=config)
        self.config, self.rank, self.engine_id = config, rank, engine_id
        self.kv_heads = topo.kv_heads_of(rank)
        caches, self.geometry = check_caches(kv_caches, config, rank, self.kv_heads, "prefill")
        self.block_epochs = torch.zeros(self.geometry.num_blocks, dtype=torch.int64)
        self._refs = [0] * self.geometry.num_blocks
        self._clock = 0  # the last epoch or free stamp issued
        self._agent = RankAgent(agent_name(engine_id, rank), caches, host, progress_thread,
                                extra=[self.block_epochs])
        self.metadata = NeuronNixlAgentMetadata(
            engine_id=engine_id, agent_name=self._agent.name,
            agent_metadata=self._agent.agent.get_agent_metadata(),
            tp_rank=rank, tp_size=config.tp,
            kv_caches_base_addr=tuple((caches[2 * i].data_ptr(), caches[2 * i + 1].data_ptr())
                                      for i in range(self.geometry.num_layers)),
            num_blocks=self.geometry.num_blocks, block_size=self.geometry.block_size,
            block_len=self.geometry.block_len, kv_heads=tuple(self.kv_heads),
            head_dim=self.geometry.head_dim, dtype=str(self.geometry.dtype).replace("torch.", ""),
            block_epochs_addr=self.block_epochs.data_ptr(), dcp_size=config.dcp)
        self.side_channel = (host, side_channel_port + rank)
        self._server = SideChannelServer(host, side_channel_port + rank,
                                         self.metadata.serialize(), key=self.key,
                                         sender=self._agent.name,
                                         client_timeout=side_channel_client_timeout)
        self.on_free = on_free
        self.leases: dict[str, _Lease] = {}
        self.released: dict[str, _Lease] = {}  # request id -> its last ended lease
        # request_id -> {(decode engine, decode rank): "read" | "empty"}, accepted ones only
        self.notifications: dict[str, dict[tuple[str, int], str]] = {}
        self.rejected: collections.deque[RejectedNotification] = collections.deque(maxlen=1000)
        self.rejected_count = 0

    # ------------------------------------------------------------------ leases
    def hold(self, request_id: str, blocks: Iterable[int], readers: Iterable[tuple[str, int]],
             *, timeout: float, epoch: int | None = None) -> int:
        """Hold ``blocks`` (the request's prefill block table) until every reader notified, or
        ``timeout`` seconds; returns the lease's epoch (pass it in the TransferRequest).

        ``readers``: (decode engine id, decode rank) pairs, e.g. ``[(eng, d) for d in
        plan.readers_of(rank)]``. ``epoch`` (default: the next) must exceed every epoch and
        free stamp this connector issued; SPMD ranks that hold the same requests in the same
        order get the same epochs either way.
        """
        if not isinstance(request_id, str) or not request_id:
            raise DCPTransferError(f"prefill rank {self.rank}: request id must be a non-empty "
                                   f"string: {request_id!r}. Pass the router's request id.")
        if request_id in self.leases:
            raise DCPTransferError(f"prefill rank {self.rank}: request {request_id!r} is already "
                                   f"held (epoch {self.leases[request_id].epoch}). Release it "
                                   f"first, or use a new request id.")
        blocks = tuple(int(b) for b in torch.as_tensor(blocks, dtype=torch.int64).reshape(-1))
        usable = self.geometry.num_blocks - 1  # the last block is the garbage block
        bad = [b for b in blocks if not 0 <= b < usable]
        if bad or len(set(blocks)) != len(blocks):
            raise DCPTransferError(
                f"prefill rank {self.rank}: request {request_id!r} names blocks {list(blocks)}: "
                f"{'out of range ' + str(bad) if bad else 'some twice'} (usable 0..{usable - 1}; "
                f"{usable} is the garbage block). Pass the request's own block table.")
        readers = {(str(e), int(d)): agent_name(str(e), int(d)) for e, d in readers}
        if not readers:
            raise DCPTransferError(f"prefill rank {self.rank}: request {request_id!r} has no "
                                   f"readers. Pass [(decode engine id, rank) for rank in "
                                   f"plan.readers_of({self.rank})].")
        if not timeout > 0:
            raise DCPTransferError(f"prefill rank {self.rank}: lease timeout must be > 0 "
                                   f"seconds: {timeout!r}. Pass how long readers may take.")
        epoch = self._clock + 1 if epoch is None else epoch
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch <= self._clock:
            raise DCPTransferError(f"prefill rank {self.rank}: epoch {epoch!r} of request "
                                   f"{request_id!r} does not exceed the last issued {self._clock}. "
                                   f"Pass a larger epoch, or none.")
        self._clock = epoch
        for b in blocks:
            if self._refs[b] == 0:
                self.block_epochs[b] = epoch
            self._refs[b] += 1
        self.leases[request_id] = _Lease(request_id, epoch, blocks, readers,
                                         time.monotonic() + timeout, timeout)
        return epoch

    def release(self, request_id: str) -> list[int]:
        """End a request's lease now (e.g. the request was cancelled); returns freed blocks."""
        lease = self.leases.get(request_id)
        if lease is None:
            raise DCPTransferError(f"prefill rank {self.rank}: request {request_id!r} is not "
                                   f"held. Release only requests that hold() returned for.")
        return self._end(lease, "released")

    def _end(self, lease: _Lease, outcome: str) -> list[int]:
        del self.leases[lease.request_id]
        lease.outcome = outcome
        self.released[lease.request_id] = lease
        freed = []
        for b in lease.blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                freed.append(b)
        if freed:  # stamped before anyone can reuse them: a later read sees the stamp
            self._clock += 1
            self.block_epochs[freed] = -self._clock
        if outcome == "expired":
            missing = sorted(set(lease.readers) - set(lease.notified))
            log.warning("prefill rank %d: request %r (epoch %d) expired after %.1f s without "
                        "notifications from %s; blocks %s freed", self.rank, lease.request_id,
                        lease.epoch, lease.timeout, missing, freed)
        if self.on_free is not None:
            self.on_free(lease.request_id, freed)
        return freed

    # ------------------------------------------------------------------ notifications
    def poll(self) -> None:
        """Progress the agent (reads need it without a progress thread), take notifications,
        and end leases whose deadline passed."""
        for sender, msgs in self._agent.agent.get_new_notifs().items():
            sender = sender.decode(errors="replace") if isinstance(sender, bytes) else str(sender)
            for m in msgs:
                self._take_notif(sender, bytes(m))
        now = time.monotonic()
        for lease in [l for l in self.leases.values() if now > l.deadline]:
            self._end(lease, "expired")

    def _take_notif(self, sender: str, raw: bytes) -> None:
        """Accept a notification only sealed under the key (auth.Opener: not forged, tampered
        or replayed) by the agent that sent it, as the plan's reader, for the lease's request
        and epoch."""
        try:
            opened = self._opener.open(raw, MessageKind.NOTIFICATION, sender=sender)
        except DCPAuthError as e:
            return self._reject(sender, None, raw, str(e))
        raw = opened.payload
        try:
            n = json.loads(raw)
            rid, epoch, key, status = n["req"], n["epoch"], (n["engine"], n["rank"]), n["status"]
            if not (isinstance(rid, str) and isinstance(key[0], str) and type(epoch) is int
                    and type(key[1]) is int):
                raise TypeError("fields of the wrong type")
        except (ValueError, KeyError, TypeError) as e:
            return self._reject(sender, None, raw, f"not a readable notification ({e})")
        lease = self.leases.get(rid)
        if lease is None:
            ended = self.released.get(rid)
            reason = (f"request {rid!r} is not held"
                      + (f" (its lease of epoch {ended.epoch} ended: {ended.outcome})"
                         if ended else ""))
        elif epoch != lease.epoch:
            reason = f"epoch {epoch} is not the lease's epoch {lease.epoch}"
        elif key not in lease.readers:
            reason = f"reader {key} is not one the plan names ({sorted(lease.readers)})"
        elif sender != lease.readers[key]:
            reason = (f"sent by agent {sender!r}, but reader {key} is agent "
                      f"{lease.readers[key]!r}")
        elif status not in NOTIF_STATUSES:
            reason = f"status {status!r} is not one of {NOTIF_STATUSES}"
        else:
            lease.notified[key] = status
            self.notifications.setdefault(rid, {})[key] = status
            if len(lease.notified) == len(lease.readers):
                self._end(lease, "read")
            return None
        return self._reject(sender, rid, raw, reason)

    def _reject(self, sender: str, request_id, raw: bytes, reason: str) -> None:
        self.rejected_count += 1
        self.rejected.append(RejectedNotification(sender, request_id, reason, raw[:256]))
        log.warning("prefill rank %d: ignored a notification from agent %r: %s", self.rank,
                    sender, reason)

    def wait_for_readers(self, request_id: str, timeout: float | None = None) -> dict:
        """Poll until ``request_id``'s lease ends; its readers' statuses if they all read.

        Raises DCPTransferError when the lease expired or was released first (its blocks
        are freed: re-run the prefill), or after ``timeout`` seconds (default: the lease's
        own deadline bounds the wait).
        """
        if request_id not in self.leases and request_id not in self.released:
            raise DCPTransferError(f"prefill rank {self.rank}: request {request_id!r} was never "
                                   f"held. Call hold() first.")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            lease = self.leases.get(request_id)
            if lease is None:
                break
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(lease.readers) - set(lease.notified))
                raise DCPTransferError(
                    f"prefill rank {self.rank}: request {request_id!r} was not read by {missing} "
                    f"within {timeout:.1f} s (its lease runs until its own deadline). Wait "
                    f"longer, or release() it.")
            time.sleep(POLL_SLEEP)
        lease = self.released[request_id]
        if lease.outcome != "read":
            missing = sorted(set(lease.readers) - set(lease.notified))
            raise DCPTransferError(
                f"prefill rank {self.rank}: request {request_id!r} (epoch {lease.epoch}) "
                f"{lease.outcome} before readers {missing} notified (lease timeout "
                f"{lease.timeout:.1f} s); its blocks were freed and a late read fails. Raise "
                f"the lease timeout, or re-run the prefill.")
        return {key: lease.notified[key] for key in sorted(lease.readers)}

    def close(self) -> None:
        self._server.close()
        self._agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


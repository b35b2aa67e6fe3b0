"""Disaggregated prefill -> decode KV transfer over NIXL (spec: "Disaggregated Inference (NIXL
Transfer)": NeuronNixlConnector, NeuronNixlAgentMetadata, Notification Handling).

One NIXL agent per rank. Each rank registers its per-layer key and value caches (CPU tensors
``[num_blocks, block_size, kv_heads_per_rank, head_dim]``, the last block the reserved garbage
block) as DRAM with the UCX backend. A decode rank READs from the prefill ranks that
:func:`dcp_compile.runtime.transfer.plan.plan_transfer` names for it; the prefill side is passive.

::

    # prefill rank p (one per rank; caches filled by the prefill program)
    pre = PrefillKVConnector(prefill_cfg, p, kv_caches, side_channel_port=PORT,
                             on_free=allocator_free)             # blocks come back here
    epoch = pre.hold("req-0", prefill_block_table,
                     [("decode", d) for d in plan.readers_of(p)], timeout=60)
    ...                                   # the router passes (id, table, epoch) to decode
    pre.poll()                            # repeatedly; ends the lease when all readers notified

    # decode rank d
    dec = DecodeKVConnector(prefill_cfg, decode_cfg, d, kv_caches, engine_id="decode",
                            side_channel_port=PORT)
    dec.handshake()                                            # metadata of all remote ranks
    dec.read(TransferRequest("req-0", seq_len, prefill_block_table, decode_block_table, epoch))

Modules: this one is the decode side (the READ state machine) and the public import path of
every name below; :mod:`dcp_compile.runtime.transfer.nixl.prefill` the prefill side (leases, epochs,
notifications), :mod:`dcp_compile.runtime.transfer.nixl.handshake` the metadata and its side channel,
:mod:`dcp_compile.runtime.transfer.nixl.descriptors` the descriptor arithmetic (no nixl import),
:mod:`dcp_compile.runtime.transfer.nixl.agent` one rank's NIXL agent and the UCX environment.

``start_read`` + ``get_finished`` is the same thing without blocking (vLLM's
start_load_kv / get_finished shape), for engines that overlap the transfer with other work.

Handshake (:mod:`dcp_compile.runtime.transfer.nixl.handshake`). Each prefill rank serves its
:class:`NeuronNixlAgentMetadata` on a TCP side channel at ``host:side_channel_port +
tp_rank``. The decode rank fetches the metadata of every remote rank of its plan (one
deadline for the whole handshake), checks it against the plan (tp, rank, dcp_size, KV heads,
block size, head_dim, dtype, layers), loads the agent metadata with ``add_remote_agent`` and
brings the connection up with a 64-byte READ of the remote garbage block (on a fresh UCX
endpoint a bare notification is only wired up by later progress and has no completion to
wait for; a READ has one).

Reads (:mod:`dcp_compile.runtime.transfer.nixl.descriptors`). Per remote rank one NIXL READ (``initialize_xfer``
with Nx3 descriptor arrays) over all layers' key and value caches: whole cache rows as one
descriptor per run of tokens; a head range of a row (splitting / merging) either staged
through a pooled, registered bounce buffer (the default) or one descriptor per token
(``partial_rows="descriptors"``).

Leases and epochs. The prefill side holds a request's blocks (:meth:`PrefillKVConnector.hold`)
until the readers the plan names have notified, or until the lease's deadline frees them; the
lease's epoch travels with the request. After a remote rank's data READ completes, the decode
rank READs that rank's epochs of the request's blocks (a registered int64 per block) and the
request completes only if every block was held, never freed, since the epoch; otherwise it
fails with DCPTransferError (the blocks may hold another request's KV by now).

Notifications (spec: Notification Handling). Each decode rank notifies every remote rank of
its plan once per request, with the request id and epoch: the notification rides on the
epoch READ (NIXL delivers it after the epochs were read, so the prefill side cannot free the
blocks before they are checked), also when the decode rank has nothing to read from that rank
(a short sequence); a request of length 0 notifies with ``send_notif``. The prefill rank
accepts a notification only for a held request, its epoch, a reader the lease names and from
that reader's own agent name; anything else is ignored, counted (``rejected_count``) and
logged. Every notification is sealed under the engines' shared key (:mod:`.auth`): one that
is unsigned, signed with another key, tampered, replayed or sealed by another agent than
its NIXL sender is refused before those checks.

Failures are errors, never a silent partial cache: a remote rank that does not answer the
handshake, metadata that does not match the plan, a NIXL error while posting or a transfer in
ERR state, a peer that died, blocks freed before their epochs were checked, or a transfer
that does not finish in time each raise :class:`DCPTransferError` within the given timeout,
and the request is not reported finished. After a failed transfer ``close()`` progresses the
agent for 0.5 s before destroying it (UCX aborts the process when an endpoint to a dead
peer is destroyed before it was discarded).

Progress (:mod:`dcp_compile.runtime.transfer.nixl.agent`, which also sets UCX's environment). Agents run
without NIXL's progress thread by default (it busy-polls a core per agent): then a transfer
advances only while both ends poll -- a prefill rank must call
:meth:`PrefillKVConnector.poll` (``wait_for_readers`` does) while decode ranks read, and a
decode rank polls in ``get_finished`` / ``wait`` (``wait_all`` for ranks sharing a process).
Pass ``progress_thread=True`` where cores are plentiful or an engine cannot poll.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransferError

from dcp_compile.runtime.transfer.nixl.agent import POLL_SLEEP, RankAgent, configure_ucx_env
from dcp_compile.runtime.transfer.nixl.auth import MessageKind, load_key, seal
from dcp_compile.runtime.transfer.nixl.descriptors import (EPOCH_BYTES, PARTIAL_ROWS, apply_staged, check_caches,
                               epoch_descriptors, plan_reads, probe_descriptor, read_epochs,
                               stage, stale_epochs)
from dcp_compile.runtime.transfer.nixl.handshake import NeuronNixlAgentMetadata, agent_name, check_metadata, fetch_metadata
from dcp_compile.runtime.transfer.nixl.prefill import PrefillKVConnector, RejectedNotification, notification
from dcp_compile.runtime.transfer.plan import TransferPlan, plan_transfer, table_entries

__all__ = [
    "NeuronNixlAgentMetadata",
    "TransferRequest",
    "TransferStats",
    "PrefillKVConnector",
    "DecodeKVConnector",
    "RejectedNotification",
    "agent_name",
    "fetch_metadata",
    "configure_ucx_env",
    "wait_all",
]


# ---------------------------------------------------------------------------------------
# Decode side
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferRequest:
    """One request's KV to pull: its length and the block table of each engine.

    Block tables have one entry per vblock (``block_size * dcp`` global positions) of the
    engine, the same on all its ranks, naming physical blocks (never the garbage block).
    ``epoch`` is the one :meth:`PrefillKVConnector.hold` returned for the request (the router
    passes it with the prefill block table); reads are verified against it.
    """

    request_id: str
    seq_len: int
    prefill_block_table: Sequence[int] | torch.Tensor
    decode_block_table: Sequence[int] | torch.Tensor
    epoch: int


@dataclass
class TransferStats:
    """One request on one decode rank. ``bytes`` crossed NIXL; ``kv_bytes`` is the KV it
    needed (less than ``bytes`` when staged head splitting reads whole remote rows)."""

    request_id: str
    bytes: int = 0
    kv_bytes: int = 0
    descriptors: int = 0
    reads: int = 0
    notify_only: int = 0
    seconds: float = 0.0
    remote_ranks: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    request: TransferRequest
    deadline: float
    start: float
    handles: dict = field(default_factory=dict)  # remote rank -> nixl_xfer_handle
    phase: dict = field(default_factory=dict)    # remote rank -> "data" | "check"
    stats: TransferStats | None = None
    staging: torch.Tensor | None = None
    staging_reg: object = None
    copies: list = field(default_factory=list)
    epoch_blocks: np.ndarray | None = None       # prefill blocks whose epochs are checked
    epochs: torch.Tensor | None = None           # landing place of those epochs, per remote
    epochs_reg: object = None


class DecodeKVConnector:
    """A decode rank: reads its share of a request's KV from the prefill ranks of its plan.

    Whole cache rows (matching heads) move as one descriptor per run of tokens. When only a
    head range of a row moves (splitting or merging; the layout keeps a token's heads
    together, so a head range is strided across tokens), ``partial_rows`` picks how:
    ``"staged"`` (default) reads the remote runs whole into a registered bounce buffer and
    copies the head range into the cache when the READs are done (one descriptor per run,
    but up to head_ratio x the bytes when splitting); ``"descriptors"`` posts one descriptor
    per token and head range (exact bytes, many small descriptors).
    """

    def __init__(self, prefill: DCPConfig, decode: DCPConfig, rank: int,
                 kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                 engine_id: str = "decode", host: str = "127.0.0.1", side_channel_port: int,
                 handshake_timeout: float = 10.0, transfer_timeout: float = 30.0,
                 progress_thread: bool = False, plan: TransferPlan | None = None,
                 partial_rows: str = "staged", key=None, insecure: bool = False):
        # The key shared with the prefill engine (auth.load_key: no key, no start).
        self.key = load_key(key, insecure=insecure, who=f"decode rank {rank}")
        if partial_rows not in PARTIAL_ROWS:
            raise DCPTransferError(f"partial_rows must be 'staged' or 'descriptors': "
                                   f"partial_rows={partial_rows!r}. Use one of them.")
        self.partial_rows = partial_rows
        if plan is not None and (plan.prefill != prefill or plan.decode != decode):
            raise DCPTransferError(f"the plan was made for other engines: plan prefill "
                                   f"TP={plan.prefill.tp}/DCP={plan.prefill.dcp}, decode TP="
                                   f"{plan.decode.tp}/DCP={plan.decode.dcp}. Pass "
                                   f"plan_transfer(prefill, decode), or no plan.")
        self.plan = plan if plan is not None else plan_transfer(prefill, decode)
        self.rank_plan = self.plan.rank(rank)
        self.prefill, self.decode, self.rank, self.engine_id = prefill, decode, rank, engine_id
        self.host, self.side_channel_port = host, side_channel_port
        self.handshake_timeout, self.transfer_timeout = handshake_timeout, transfer_timeout
        caches, self.geometry = check_caches(kv_caches, decode, rank,
                                              list(self.rank_plan.kv_heads), "decode")
        self.kv_caches = [tuple(kv) for kv in kv_caches]
        self._agent = RankAgent(agent_name(engine_id, rank), caches, host, progress_thread)
        self._local_bases = np.array([t.data_ptr() for t in caches], dtype=np.uint64)
        self.remotes: dict[int, tuple[str, NeuronNixlAgentMetadata]] = {}
        self._pending: dict[str, _Pending] = {}
        self._buffers: list = []  # (registered bounce buffer, its NIXL registration), reused
        self.finished_stats: dict[str, TransferStats] = {}
        self.failed: dict[str, str] = {}

    # ------------------------------------------------------------------ handshake
    def handshake(self, timeout: float | None = None, *, listening: bool = False) -> None:
        """Fetch, check and load the metadata of every remote rank the plan names.

        ``listening``: every remote side channel is known to have been up (the prefill side
        published its handoff after they came up), so a refused connection fails at once,
        naming the remote rank whose process is gone (``fetch_metadata``)."""
        timeout = self.handshake_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for p in self.rank_plan.remote_ranks:
            if p in self.remotes:
                continue
            raw = fetch_metadata(self.host, self.side_channel_port + p, deadline,
                                 key=self.key, sender=self._agent.name,
                                 what=f"decode rank {self.rank}: prefill rank {p}",
                                 listening=listening)
            md = NeuronNixlAgentMetadata.deserialize(raw)
            check_metadata(md, p, self.prefill, self.geometry, decode_rank=self.rank)
            try:
                name = self._agent.agent.add_remote_agent(md.agent_metadata)
            except Exception as e:
                raise DCPTransferError(f"decode rank {self.rank}: loading the NIXL metadata of "
                                       f"prefill rank {p} ({md.agent_name}) failed: "
                                       f"{type(e).__name__}: {e}. Is the prefill process alive?"
                                       ) from e
            name = name.decode() if isinstance(name, bytes) else name
            self._probe(p, name, md, deadline)
            self.remotes[p] = (name, md)

    def _probe(self, p: int, name: str, md: NeuronNixlAgentMetadata, deadline: float) -> None:
        """Bring the UCX connection up now with a tiny READ of the remote garbage block.

        Without a progress thread, a bare send_notif on a fresh endpoint waits for the
        connection to be wired up by later progress and has no completion to wait on; a READ
        does. After it, notify-only messages leave at once, and a remote that cannot be reached
        fails here, in the handshake, with a bounded wait.
        """
        api = self._agent.agent
        scratch = self._agent.scratch
        garbage_row, n = probe_descriptor(md, scratch.numel())
        try:
            handle = api.initialize_xfer(
                "READ", api.get_xfer_descs([(scratch.data_ptr(), n, 0)], "DRAM"),
                api.get_xfer_descs([(garbage_row, n, 0)], "DRAM"), name, b"")
            state = api.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(POLL_SLEEP)
                state = api.check_xfer_state(handle)
        except Exception as e:
            raise DCPTransferError(f"decode rank {self.rank}: connecting to prefill rank {p} "
                                   f"({md.agent_name}) failed: {type(e).__name__}: {e}. Is the "
                                   f"prefill process alive?") from e
        try:
            handle.release()
        except Exception:
            pass
        if state != "DONE":
            raise DCPTransferError(f"decode rank {self.rank}: connecting to prefill rank {p} "
                                   f"({md.agent_name}) ended in state {state} before the handshake "
                                   f"deadline. Is the prefill process alive and polling?")

    # ------------------------------------------------------------------ reading
    def start_read(self, request: TransferRequest, timeout: float | None = None) -> None:
        """Post every READ of ``request`` (and the notify-only messages); do not wait."""
        rid = request.request_id
        if rid in self._pending or rid in self.finished_stats or rid in self.failed:
            raise DCPTransferError(f"decode rank {self.rank}: request {rid!r} was already "
                                   f"started. Use a new request id per transfer.")
        missing = [p for p in self.rank_plan.remote_ranks if p not in self.remotes]
        if missing:
            raise DCPTransferError(f"decode rank {self.rank}: no handshake with prefill ranks "
                                   f"{missing}. Call handshake() before start_read().")
        if type(request.epoch) is not int or request.epoch <= 0:
            raise DCPTransferError(f"decode rank {self.rank}: request {rid!r} has epoch "
                                   f"{request.epoch!r}. Pass the positive epoch that "
                                   f"PrefillKVConnector.hold() returned for it.")
        now = time.monotonic()
        timeout = self.transfer_timeout if timeout is None else timeout
        pend = _Pending(request=request, deadline=now + timeout, start=now,
                        stats=TransferStats(rid, remote_ranks=self.rank_plan.remote_ranks))
        self._check_tables(request)
        api = self._agent.agent
        try:
            reads = self._build_reads(request, pend)
            need = table_entries(request.seq_len, self.prefill)
            pend.epoch_blocks = (torch.as_tensor(request.prefill_block_table, dtype=torch.int64)
                                 .reshape(-1)[:need].numpy().astype(np.uint64))
            if need:
                pend.epochs, pend.epochs_reg = self._take_buffer(
                    len(reads) * need * EPOCH_BYTES)
            for p, rr in reads.items():
                name, _ = self.remotes[p]
                if rr is None:  # spec: still notify when there is nothing to read
                    pend.stats.notify_only += 1
                    if need:  # the epochs are checked all the same (and carry the notif)
                        self._post_epoch_check(pend, p, "empty")
                    else:
                        api.send_notif(name, self._notif(request, "empty"))
                    continue
                local, remote = np.concatenate(rr.local), np.concatenate(rr.remote)
                handle = api.initialize_xfer("READ", api.get_xfer_descs(local, "DRAM"),
                                             api.get_xfer_descs(remote, "DRAM"), name, b"")
                pend.handles[p], pend.phase[p] = handle, "data"
                if api.transfer(handle) == "ERR":
                    raise DCPTransferError("posting the READ returned ERR")
                pend.stats.reads += 1
                pend.stats.bytes += rr.bytes
                pend.stats.kv_bytes += rr.kv_bytes
                pend.stats.descriptors += len(local)
        except Exception as e:
            try:
                self._fail(pend, f"posting failed: {type(e).__name__}: {e}", e)
            except DCPTransferError as err:
                self.failed[rid] = str(err)
                raise
        self._pending[rid] = pend

    def get_finished(self) -> set[str]:
        """Requests whose reads all completed since the last call.

        A failed request raises DCPTransferError after every other request was advanced; the
        exception carries ``.finished`` (completed in this call) and ``.failed`` (request id ->
        reason), and ``self.failed`` keeps the reasons. A failed request is never finished.
        """
        done, failed = set(), {}
        for rid, pend in list(self._pending.items()):
            try:
                if self._advance(pend):
                    done.add(rid)
            except DCPTransferError as e:
                failed[rid] = e
        if failed:
            self.failed.update({rid: str(e) for rid, e in failed.items()})
            first = next(iter(failed.values()))
            first.finished, first.failed = done, {rid: str(e) for rid, e in failed.items()}
            raise first
        return done

    def _advance(self, pend: _Pending) -> bool:
        """Poll one request's READs; True once all are done and staged rows are in place."""
        rid, api = pend.request.request_id, self._agent.agent
        for p, handle in list(pend.handles.items()):
            try:
                state = api.check_xfer_state(handle)
            except Exception as e:
                del self._pending[rid]
                self._fail(pend, f"checking the READ from prefill rank {p} failed: "
                                 f"{type(e).__name__}: {e}", e)
            if state == "DONE":
                handle.release()
                del pend.handles[p]
                if pend.phase.pop(p) == "data":  # data in: now its blocks' epochs
                    try:
                        self._post_epoch_check(pend, p, "read")
                    except Exception as e:
                        del self._pending[rid]
                        self._fail(pend, f"posting the epoch READ to prefill rank {p} failed: "
                                         f"{type(e).__name__}: {e}", e)
            elif state == "ERR":
                del self._pending[rid]
                self._fail(pend, f"the READ from prefill rank {p} is in ERR state")
        if pend.handles:
            if time.monotonic() > pend.deadline:
                del self._pending[rid]
                self._fail(pend, f"READs from prefill ranks {sorted(pend.handles)} did not "
                                 f"complete within {pend.deadline - pend.start:.1f} s")
            return False
        self._check_epochs(pend)
        self._finish_staged(pend)
        pend.stats.seconds = time.monotonic() - pend.start
        self.finished_stats[rid] = pend.stats
        del self._pending[rid]
        return True

    def wait(self, request_id: str, poll_interval: float = 0.0) -> TransferStats:
        """Block until ``request_id`` finished (bounded by its timeout); raise if it failed.

        Without a progress thread the READs advance only while this rank polls, so the
        default polls back to back (yielding the CPU between polls).
        """
        return wait_all([self], request_id, poll_interval)[0]

    def read(self, request: TransferRequest, timeout: float | None = None) -> TransferStats:
        """start_read + wait."""
        self.start_read(request, timeout)
        return self.wait(request.request_id)

    def close(self) -> None:
        for pend in self._pending.values():
            self._release(pend)
        self._pending.clear()
        for _, reg in self._buffers:
            try:
                self._agent.agent.deregister_memory(reg)
            except Exception:
                pass
        self._buffers.clear()
        self._agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals
    def _notif(self, request: TransferRequest, status: str) -> bytes:
        return seal(self.key, MessageKind.NOTIFICATION, self._agent.name,
                    notification(request.request_id, request.epoch, self.engine_id, self.rank,
                                 status))[0]

    def _fail(self, pend: _Pending, why: str, cause: Exception | None = None):
        self._agent.peer_failed = True
        self._release(pend)
        msg = (f"KV transfer of request {pend.request.request_id!r} to decode rank {self.rank} "
               f"failed: {why}. The request's decode cache is incomplete and must not be used; "
               f"retry the read or re-run its prefill.")
        raise DCPTransferError(msg) from cause

    def _release(self, pend: _Pending):
        for handle in pend.handles.values():
            try:
                handle.release()
            except Exception:
                pass  # NIXL keeps a handle it cannot abort in its leak list
        pend.handles.clear()
        for buf, reg in ((pend.staging, pend.staging_reg), (pend.epochs, pend.epochs_reg)):
            if buf is not None:  # back to the pool: registering anew costs a post
                self._buffers.append((buf, reg))
        pend.staging, pend.staging_reg, pend.copies = None, None, []
        pend.epochs, pend.epochs_reg = None, None

    def _finish_staged(self, pend: _Pending) -> None:
        """Copy staged rows into their head ranges; only then is the request complete."""
        apply_staged(pend.staging, pend.copies, self._agent.caches, self.geometry)
        self._release(pend)

    def _check_tables(self, req: TransferRequest) -> None:
        for side, table, cfg, nb in (
                ("prefill", req.prefill_block_table, self.prefill,
                 min((md.num_blocks for _, md in self.remotes.values()), default=None)),
                ("decode", req.decode_block_table, self.decode, self.geometry.num_blocks)):
            need = table_entries(req.seq_len, cfg)
            t = torch.as_tensor(table, dtype=torch.int64).reshape(-1)[:need]
            if nb is not None and t.numel() and int(t.max()) >= nb - 1:
                raise DCPTransferError(
                    f"request {req.request_id!r}: {side} block table names block {int(t.max())}, "
                    f"but blocks are 0..{nb - 2} ({nb - 1} is the reserved garbage block). "
                    f"Allocate blocks below {nb - 1}.")

    def _build_reads(self, req: TransferRequest, pend: _Pending) -> dict:
        """remote rank -> RemoteRead, or None when there is nothing to read from it; staged
        runs get a pooled bounce buffer and their copies are recorded for the end."""
        reads, staged = plan_reads(self.plan, self.rank, req.seq_len, req.prefill_block_table,
                                   req.decode_block_table,
                                   {p: md for p, (_, md) in self.remotes.items()},
                                   self.geometry, self._local_bases, self.partial_rows)
        if staged:
            pend.staging, pend.staging_reg = self._take_buffer(sum(s.nbytes for s in staged))
            pend.copies = stage(staged, self.geometry, pend.staging.data_ptr())
        return reads

    def _take_buffer(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """A registered uint8 buffer of at least ``nbytes`` from the pool (or a new one)."""
        fits = [i for i, (buf, _) in enumerate(self._buffers) if buf.numel() >= nbytes]
        if fits:
            return self._buffers.pop(min(fits, key=lambda i: self._buffers[i][0].numel()))
        buf = torch.empty(max(nbytes, EPOCH_BYTES), dtype=torch.uint8)
        return buf, self._agent.agent.register_memory(buf)

    def _post_epoch_check(self, pend: _Pending, p: int, status: str) -> None:
        """READ prefill rank p's epochs of the request's blocks, after its data; the READ
        carries the notification, which NIXL delivers once the epochs have been read (so the
        prefill side cannot free the blocks before they are checked)."""
        api, (name, md) = self._agent.agent, self.remotes[p]
        blocks = pend.epoch_blocks
        local, remote = epoch_descriptors(pend.epochs.data_ptr(),
                                          self.rank_plan.remote_ranks.index(p),
                                          md.block_epochs_addr, blocks)
        handle = api.initialize_xfer("READ", api.get_xfer_descs(local, "DRAM"),
                                     api.get_xfer_descs(remote, "DRAM"), name,
                                     self._notif(pend.request, status))
        pend.handles[p], pend.phase[p] = handle, "check"
        if api.transfer(handle) == "ERR":
            raise DCPTransferError("posting the epoch READ returned ERR")

    def _check_epochs(self, pend: _Pending) -> None:
        """Every block read must still be held since the request's epoch: ``0 < e <= epoch``."""
        if pend.epochs is None:
            return
        remotes, blocks = self.rank_plan.remote_ranks, pend.epoch_blocks
        got = read_epochs(pend.epochs, len(remotes), len(blocks))
        epoch = pend.request.epoch
        bad = stale_epochs(got, epoch)
        if len(bad):
            i, j = bad[0].tolist()
            e = int(got[i, j])
            state = ("freed" if e < 0 else "never held" if e == 0 else
                     f"freed and held again by a later lease (epoch {e})")
            del self._pending[pend.request.request_id]
            self._fail(pend, f"prefill rank {remotes[i]} does not hold block {int(blocks[j])} "
                             f"since epoch {epoch}: it was {state} ({len(bad)} block epochs "
                             f"wrong); the bytes read may be another request's KV")


def wait_all(connectors: Sequence[DecodeKVConnector], request_id: str,
             poll_interval: float = 0.0) -> list[TransferStats]:
    """Wait for ``request_id`` on several decode ranks of this process, polling them in turn.

    Ranks that share a process (tests, benchmarks) must be progressed together: waiting on
    one rank at a time would leave the others' READs idle.
    """
    waiting = list(connectors)
    while waiting:
        for c in list(waiting):
            if request_id in c.finished_stats:
                waiting.remove(c)
                continue
            if request_id in c.failed:
                raise DCPTransferError(c.failed[request_id])
            if request_id not in c._pending:
                raise DCPTransferError(f"decode rank {c.rank}: request {request_id!r} is not "
                                       f"in flight. Call start_read() first.")
            try:
                c.get_finished()
            except DCPTransferError as e:
                if request_id in getattr(e, "failed", {request_id: None}):
                    raise
                # another request failed; it is recorded in c.failed for its own waiter
        if waiting:
            time.sleep(poll_interval)
    return [c.finished_stats[request_id] for c in connectors]

"""Disaggregated prefill -> decode KV transfer over NIXL (spec: "Disaggregated Inference (NIXL
Transfer)": NeuronNixlConnector, NeuronNixlAgentMetadata, Notification Handling).

One NIXL agent per rank. Each rank registers its per-layer key and value caches (CPU tensors
``[num_blocks, block_size, kv_heads_per_rank, head_dim]``, the last block the reserved garbage
block) as DRAM with the UCX backend. A decode rank READs from the prefill ranks that
:func:`runtime.transfer_plan.plan_transfer` names for it; the prefill side is passive.

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

``start_read`` + ``get_finished`` is the same thing without blocking (vLLM's
start_load_kv / get_finished shape), for engines that overlap the transfer with other work.

Handshake (side channel). Each prefill rank serves its :class:`NeuronNixlAgentMetadata` --
the NIXL agent metadata plus the spec's ``dcp_size`` extension and the cache geometry -- on a
small TCP side channel at ``host:side_channel_port + tp_rank`` (vLLM's NIXL side channel uses
the same base-port-plus-rank convention). Protocol: the client sends ``DCPKV-META 2\\n``; the
server answers an 8-byte big-endian length and the JSON-serialised metadata (no pickle: the
bytes come from the network). The server runs each client on its own thread (at most 64 at
once) with one deadline for its whole exchange; the client too has one deadline for the whole
handshake (the remaining time is recomputed for every recv) and refuses a length above 1 MiB
before allocating. The channel has no authentication: bind it to loopback or a trusted
network. The decode rank fetches the metadata of every remote rank of its
plan, checks it against the plan (tp, rank, dcp_size, KV heads, block size, head_dim, dtype,
layers), loads the agent metadata with ``add_remote_agent`` and brings the connection up with
a 64-byte READ of the remote garbage block (on a fresh UCX endpoint a bare notification is
only wired up by later progress and has no completion to wait for; a READ has one).

Reads. Per remote rank one NIXL READ (``initialize_xfer`` with Nx3 descriptor arrays) over
all layers' key and value caches. Whole cache rows move as one descriptor per run of tokens
(a block, or less at the end); a head range of a row (splitting / merging) is strided across
tokens in this layout, so it is either staged (the remote run read whole into a pooled,
registered bounce buffer, then copied into the head range; the default) or one descriptor
per token (``partial_rows="descriptors"``).

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
logged. Agent names are self-declared by the peers: this stops misrouted or stale
notifications, not a malicious peer on the network.

Failures are errors, never a silent partial cache: a remote rank that does not answer the
handshake, metadata that does not match the plan, a NIXL error while posting or a transfer in
ERR state, a peer that died, blocks freed before their epochs were checked, or a transfer
that does not finish in time each raise :class:`DCPTransferError` within the given timeout,
and the request is not reported finished. After a failed transfer ``close()`` progresses the
agent for 0.5 s before destroying it (UCX aborts the process when an endpoint to a dead
peer is destroyed before it was discarded).

Environment. UCX reads its settings when the first agent is created: unless already set,
``UCX_TLS=tcp,self,sm`` and, for a loopback side channel, ``UCX_NET_DEVICES=lo`` (so UCX does
not advertise other interfaces). On CPU ``UCX_TLS`` must include ``tcp``. Agents run without
NIXL's progress thread by default (it busy-polls a core per agent, too much for a few cores):
then a transfer advances only while both ends poll -- a prefill rank must call
:meth:`PrefillKVConnector.poll` (``wait_for_readers`` does) while decode ranks read, and a
decode rank polls in ``get_finished`` / ``wait`` (``wait_all`` for ranks sharing a process).
Pass ``progress_thread=True`` where cores are plentiful or an engine cannot poll.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from dcp_compile import layout
from dcp_compile.config import DCPConfig
from dcp_compile.errors import DCPTransferError
from dcp_compile.topology import topology

from .transfer_plan import TransferPlan, plan_transfer

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

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_HELLO = b"DCPKV-META 2\n"
_MD_FORMAT = "dcp-nixl-agent-metadata/2"
_POLL_SLEEP = 0.0005
MAX_MESSAGE = 1 << 20                # bytes a side-channel message may announce
SIDE_CHANNEL_CLIENT_TIMEOUT = 5.0    # seconds one client's whole exchange may take
SIDE_CHANNEL_MAX_CLIENTS = 64        # exchanges served at once (a thread each)
_EPOCH_BYTES = 8                     # one int64 block epoch (see PrefillKVConnector.hold)
_NOTIF_STATUSES = ("read", "empty")
_DRAIN_SECONDS = 0.5                 # progress after a failed transfer, before teardown

log = logging.getLogger(__name__)


def agent_name(engine_id: str, rank: int) -> str:
    """The NIXL agent name of ``rank`` of engine ``engine_id`` (both sides use it)."""
    return f"{engine_id}-rank{rank}"


# ---------------------------------------------------------------------------------------
# Metadata (spec: NeuronNixlAgentMetadata = NixlAgentMetadata + dcp_size)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeuronNixlAgentMetadata:
    """What a prefill rank tells a decode rank in the handshake.

    ``dcp_size`` is the spec's extension (0: not advertised, i.e. an engine without DCP);
    the rest is the NIXL agent metadata and the geometry the decode side needs to address
    remote rows. ``block_len`` is the bytes of one block of one layer's key (or value) cache;
    ``block_epochs_addr`` is the registered int64 array of block epochs (one per block) that a
    decode rank reads after its data to prove the blocks were not freed meanwhile.
    """

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    tp_rank: int
    tp_size: int
    kv_caches_base_addr: tuple[tuple[int, int], ...]
    num_blocks: int
    block_size: int
    block_len: int
    kv_heads: tuple[int, ...]
    head_dim: int
    dtype: str
    block_epochs_addr: int
    dcp_size: int = 0

    def serialize(self) -> bytes:
        d = asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
        d["format"] = _MD_FORMAT
        return json.dumps(d).encode()

    @classmethod
    def deserialize(cls, raw: bytes) -> "NeuronNixlAgentMetadata":
        try:
            d = json.loads(raw)
            if d.pop("format", None) != _MD_FORMAT:
                raise ValueError(f"format is not {_MD_FORMAT}")
            d["agent_metadata"] = base64.b64decode(d["agent_metadata"])
            d["kv_caches_base_addr"] = tuple(tuple(int(a) for a in kv)
                                             for kv in d["kv_caches_base_addr"])
            d["kv_heads"] = tuple(d["kv_heads"])
            return cls(**d)
        except (ValueError, TypeError, KeyError) as e:
            raise DCPTransferError(f"handshake metadata is not readable: {e}. Connect to a "
                                   f"PrefillKVConnector side channel of this version.") from e

    @property
    def effective_dcp(self) -> int:
        return self.dcp_size if self.dcp_size > 0 else 1


# ---------------------------------------------------------------------------------------
# Side channel
# ---------------------------------------------------------------------------------------


class _SideChannelServer:
    """Serves one payload to every client that says hello, each client on its own thread.

    A client gets ``client_timeout`` seconds for the whole exchange (one deadline, not one
    per recv), so an idle or trickling client holds one handler thread at most that long and
    never delays another client. At most ``max_clients`` exchanges run at once; a client
    beyond that is closed at once (bounded threads; the channel has no authentication).
    """

    def __init__(self, host: str, port: int, payload: bytes, *,
                 client_timeout: float = SIDE_CHANNEL_CLIENT_TIMEOUT,
                 max_clients: int = SIDE_CHANNEL_MAX_CLIENTS):
        self._payload = struct.pack(">Q", len(payload)) + payload
        self._client_timeout = client_timeout
        self._slots = threading.BoundedSemaphore(max_clients)
        self._clients: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise DCPTransferError(f"side channel cannot listen: {host}:{port}: {e}. Pick a free "
                                   f"side_channel_port (base port + tp_rank must be free).") from e
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"dcp-kv-side-{port}",
                                        daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many exchanges at once: this client retries
                continue
            with self._lock:
                self._clients.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"dcp-kv-side-client-{self._sock.getsockname()[1]}").start()

    def _serve(self, conn: socket.socket):
        deadline = time.monotonic() + self._client_timeout
        try:
            if _recv_exact(conn, len(_HELLO), deadline) == _HELLO:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                conn.sendall(self._payload)
        except (OSError, ConnectionError):
            pass  # a client that hangs up, stalls or speaks another protocol is dropped
        finally:
            with self._lock:
                self._clients.discard(conn)
            conn.close()
            self._slots.release()

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()
        with self._lock:
            clients = list(self._clients)
        for conn in clients:  # wakes their handler threads, which then exit
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes before ``deadline`` (time.monotonic()): the remaining time is recomputed
    for every recv, so a peer that trickles bytes cannot stretch the exchange."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"deadline passed after {len(buf)} of {n} bytes")
        conn.settimeout(left)
        part = conn.recv(min(n - len(buf), 1 << 16))
        if not part:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def fetch_metadata(host: str, port: int, deadline: float, *, what: str = "remote rank",
                   max_message: int = MAX_MESSAGE) -> bytes:
    """The side-channel payload at host:port; retries until ``deadline`` (time.monotonic()).

    The whole exchange (connect, hello, length, payload) shares the one deadline. A length
    prefix above ``max_message`` is refused before anything is allocated.
    """
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=left) as conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                conn.sendall(_HELLO)
                (n,) = struct.unpack(">Q", _recv_exact(conn, 8, deadline))
                if n > max_message:
                    raise DCPTransferError(
                        f"{what}: the side channel at {host}:{port} announced a message of {n} "
                        f"bytes, above the limit of {max_message} bytes. Connect to a "
                        f"PrefillKVConnector side channel (its metadata is a few KiB).")
                return _recv_exact(conn, n, deadline)
        except (OSError, ConnectionError) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
    raise DCPTransferError(f"{what} did not answer the handshake at {host}:{port} in time "
                           f"(last error: {last}). Check that the prefill engine is running and "
                           f"its side_channel_port, or raise handshake_timeout.")


# ---------------------------------------------------------------------------------------
# NIXL agent set-up
# ---------------------------------------------------------------------------------------


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
    from runtime.nixl_build import nixl_api
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


@dataclass(frozen=True)
class _CacheGeometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    element_size: int

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.element_size

    @property
    def row_bytes(self) -> int:
        return self.num_heads * self.head_bytes

    @property
    def block_len(self) -> int:
        return self.block_size * self.row_bytes


def _check_caches(kv_caches, cfg: DCPConfig, rank: int, heads: list[int],
                  side: str) -> tuple[list[torch.Tensor], _CacheGeometry]:
    caches = []
    for i, kv in enumerate(kv_caches):
        if len(kv) != 2:
            raise DCPTransferError(f"{side} rank {rank}: layer {i} must be a (key, value) pair: "
                                   f"got {len(kv)} tensors. Pass [(k_cache, v_cache), ...].")
        caches.extend(kv)
    if not caches:
        raise DCPTransferError(f"{side} rank {rank}: no KV caches given. Pass one (key, value) "
                               f"pair per layer.")
    t0 = caches[0]
    want = ("num_blocks", cfg.block_size, len(heads), "head_dim")
    for t in caches:
        bad = (t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 4
               or t.shape[1] != cfg.block_size or t.shape[2] != len(heads)
               or t.shape != t0.shape or t.dtype != t0.dtype or t.shape[0] < 2)
        if bad:
            raise DCPTransferError(
                f"{side} rank {rank}: KV caches must be contiguous CPU tensors of one shape "
                f"[num_blocks >= 2, block_size, kv_heads_per_rank, head_dim] = {list(want)}: got "
                f"{t.device.type} {t.dtype} {list(t.shape)} contiguous={t.is_contiguous()}. "
                f"Allocate them per the layout (last block = garbage block).")
    geo = _CacheGeometry(num_layers=len(caches) // 2, num_blocks=t0.shape[0],
                         block_size=t0.shape[1], num_heads=t0.shape[2], head_dim=t0.shape[3],
                         dtype=t0.dtype, element_size=t0.element_size())
    return caches, geo


class _RankAgent:
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
            time.sleep(_POLL_SLEEP)

    def close(self):
        if self.peer_failed:
            self.drain()
        reg, self._reg = self._reg, None
        if reg is not None:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass  # tearing down; the agent's destructor releases the rest


# ---------------------------------------------------------------------------------------
# Prefill side
# ---------------------------------------------------------------------------------------


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
                 on_free=None, side_channel_client_timeout: float = SIDE_CHANNEL_CLIENT_TIMEOUT):
        if config.mode != "prefill":
            raise DCPTransferError(f"PrefillKVConnector needs the prefill engine's config: "
                                   f"mode={config.mode!r}. Pass DCPConfig(..., mode='prefill').")
        topo = topology(config.tp, config.dcp, config.mode, config=config)
        self.config, self.rank, self.engine_id = config, rank, engine_id
        self.kv_heads = topo.kv_heads_of(rank)
        caches, self.geometry = _check_caches(kv_caches, config, rank, self.kv_heads, "prefill")
        self.block_epochs = torch.zeros(self.geometry.num_blocks, dtype=torch.int64)
        self._refs = [0] * self.geometry.num_blocks
        self._clock = 0  # the last epoch or free stamp issued
        self._agent = _RankAgent(agent_name(engine_id, rank), caches, host, progress_thread,
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
        self._server = _SideChannelServer(host, side_channel_port + rank,
                                          self.metadata.serialize(),
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
        """Accept a notification only as the plan's reader, for the lease's request and epoch."""
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
        elif status not in _NOTIF_STATUSES:
            reason = f"status {status!r} is not one of {_NOTIF_STATUSES}"
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
            time.sleep(_POLL_SLEEP)
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
class _RemoteRead:
    """Everything read from one remote rank for one request: NIXL descriptor arrays."""

    local: list = field(default_factory=list)   # Nx3 arrays, concatenated when posted
    remote: list = field(default_factory=list)
    bytes: int = 0
    kv_bytes: int = 0


@dataclass
class _StagedCopy:
    """After the READs: staging rows -> the head range of local cache rows (one tensor)."""

    tensor: int
    staging_offset: int    # bytes into the staging buffer
    rows: torch.Tensor     # local cache rows, one per staged row
    remote_heads: int
    remote_head_offset: int
    local_head_offset: int
    num_heads: int


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
                 partial_rows: str = "staged"):
        if partial_rows not in ("staged", "descriptors"):
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
        caches, self.geometry = _check_caches(kv_caches, decode, rank,
                                              list(self.rank_plan.kv_heads), "decode")
        self.kv_caches = [tuple(kv) for kv in kv_caches]
        self._agent = _RankAgent(agent_name(engine_id, rank), caches, host, progress_thread)
        self._local_bases = np.array([t.data_ptr() for t in caches], dtype=np.uint64)
        self.remotes: dict[int, tuple[str, NeuronNixlAgentMetadata]] = {}
        self._pending: dict[str, _Pending] = {}
        self._buffers: list = []  # (registered bounce buffer, its NIXL registration), reused
        self.finished_stats: dict[str, TransferStats] = {}
        self.failed: dict[str, str] = {}

    # ------------------------------------------------------------------ handshake
    def handshake(self, timeout: float | None = None) -> None:
        """Fetch, check and load the metadata of every remote rank the plan names."""
        timeout = self.handshake_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for p in self.rank_plan.remote_ranks:
            if p in self.remotes:
                continue
            raw = fetch_metadata(self.host, self.side_channel_port + p, deadline,
                                 what=f"decode rank {self.rank}: prefill rank {p}")
            md = NeuronNixlAgentMetadata.deserialize(raw)
            self._check_remote(md, p)
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
        garbage_row = md.kv_caches_base_addr[0][0] + (md.num_blocks - 1) * md.block_len
        n = min(scratch.numel(), md.block_len)
        try:
            handle = api.initialize_xfer(
                "READ", api.get_xfer_descs([(scratch.data_ptr(), n, 0)], "DRAM"),
                api.get_xfer_descs([(garbage_row, n, 0)], "DRAM"), name, b"")
            state = api.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(_POLL_SLEEP)
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

    def _check_remote(self, md: NeuronNixlAgentMetadata, p: int) -> None:
        g, pc = self.geometry, self.prefill
        remote_heads = tuple(topology(pc.tp, pc.dcp, pc.mode, config=pc).kv_heads_of(p))
        expect = {
            "tp_rank": (md.tp_rank, p), "tp_size": (md.tp_size, pc.tp),
            "dcp_size": (md.effective_dcp, pc.dcp), "kv_heads": (md.kv_heads, remote_heads),
            "block_size": (md.block_size, pc.block_size), "head_dim": (md.head_dim, g.head_dim),
            "dtype": (md.dtype, str(g.dtype).replace("torch.", "")),
            "num_layers": (len(md.kv_caches_base_addr), g.num_layers),
            "block_len": (md.block_len,
                          pc.block_size * len(remote_heads) * g.head_dim * g.element_size),
        }
        wrong = [f"{k} advertised {got!r}, plan expects {want!r}"
                 for k, (got, want) in expect.items() if got != want]
        if md.num_blocks < 2:
            wrong.append(f"num_blocks advertised {md.num_blocks}, needs >= 2")
        if wrong:
            raise DCPTransferError(
                f"decode rank {self.rank}: handshake metadata of prefill rank {p} "
                f"({md.agent_name}, engine {md.engine_id!r}) does not match the transfer plan "
                f"(prefill TP={pc.tp}/DCP={pc.dcp}): {'; '.join(wrong)}. Plan with the prefill "
                f"engine's real layout, or connect to the right engine.")

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
            need = -(-request.seq_len // self.prefill.vblock)
            pend.epoch_blocks = (torch.as_tensor(request.prefill_block_table, dtype=torch.int64)
                                 .reshape(-1)[:need].numpy().astype(np.uint64))
            if need:
                pend.epochs, pend.epochs_reg = self._take_buffer(
                    len(reads) * need * _EPOCH_BYTES)
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
        return json.dumps({"req": request.request_id, "epoch": request.epoch,
                           "engine": self.engine_id, "rank": self.rank,
                           "status": status}).encode()

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
        g, caches = self.geometry, self._agent.caches
        for c in pend.copies:
            n = len(c.rows)
            src = pend.staging[c.staging_offset:c.staging_offset + n * c.remote_heads
                               * g.head_bytes].view(g.dtype).view(n, c.remote_heads, g.head_dim)
            dst = caches[c.tensor].view(-1, g.num_heads, g.head_dim)
            dst[c.rows, c.local_head_offset:c.local_head_offset + c.num_heads] = \
                src[:, c.remote_head_offset:c.remote_head_offset + c.num_heads]
        self._release(pend)

    def _check_tables(self, req: TransferRequest) -> None:
        for side, table, cfg, nb in (
                ("prefill", req.prefill_block_table, self.prefill,
                 min((md.num_blocks for _, md in self.remotes.values()), default=None)),
                ("decode", req.decode_block_table, self.decode, self.geometry.num_blocks)):
            need = -(-req.seq_len // cfg.vblock)
            t = torch.as_tensor(table, dtype=torch.int64).reshape(-1)[:need]
            if nb is not None and t.numel() and int(t.max()) >= nb - 1:
                raise DCPTransferError(
                    f"request {req.request_id!r}: {side} block table names block {int(t.max())}, "
                    f"but blocks are 0..{nb - 2} ({nb - 1} is the reserved garbage block). "
                    f"Allocate blocks below {nb - 1}.")

    def _build_reads(self, req: TransferRequest, pend: _Pending) -> dict:
        """remote rank -> _RemoteRead, or None when there is nothing to read from it."""
        g = self.geometry
        out: dict = {p: None for p in self.rank_plan.remote_ranks}
        staged = []
        for read in self.rank_plan.reads:
            _, md = self.remotes[read.remote_rank]
            chunks = self.plan.chunks(self.rank, read.remote_cp_rank, req.seq_len,
                                      req.prefill_block_table, req.decode_block_table)
            if len(chunks) == 0:
                continue
            rr = out[read.remote_rank] = out[read.remote_rank] or _RemoteRead()
            r_row_bytes = len(md.kv_heads) * g.head_bytes
            r_bases = np.array([a for kv in md.kv_caches_base_addr for a in kv], dtype=np.uint64)
            r_rows = layout.physical_slot(chunks[:, 2], chunks[:, 1], block=self.prefill.block_size)
            l_rows = layout.physical_slot(chunks[:, 4], chunks[:, 3], block=self.decode.block_size)
            length = chunks[:, 5]
            rr.kv_bytes += int(length.sum()) * read.num_heads * g.head_bytes * len(r_bases)
            if read.num_heads == len(md.kv_heads) == g.num_heads:
                # Whole rows on both sides: one descriptor per run.
                size = length * g.row_bytes
                rr.local.append(_nx3(self._local_bases, l_rows * g.row_bytes, size))
                rr.remote.append(_nx3(r_bases, r_rows * r_row_bytes, size))
                rr.bytes += int(size.sum()) * len(r_bases)
            elif self.partial_rows == "descriptors":
                # One descriptor per token and head range.
                first = torch.cumsum(length, 0) - length
                idx = torch.repeat_interleave(torch.arange(len(chunks)), length)
                step = torch.arange(len(idx)) - first[idx]
                r_off = (r_rows[idx] + step) * r_row_bytes + read.remote_head_offset * g.head_bytes
                l_off = (l_rows[idx] + step) * g.row_bytes + read.local_head_offset * g.head_bytes
                size = torch.full_like(r_off, read.num_heads * g.head_bytes)
                rr.local.append(_nx3(self._local_bases, l_off, size))
                rr.remote.append(_nx3(r_bases, r_off, size))
                rr.bytes += int(size.sum()) * len(r_bases)
            else:
                staged.append((read, rr, r_bases, r_row_bytes, r_rows, l_rows, length))
        if staged:
            self._stage(staged, pend)
        return out

    def _take_buffer(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """A registered uint8 buffer of at least ``nbytes`` from the pool (or a new one)."""
        fits = [i for i, (buf, _) in enumerate(self._buffers) if buf.numel() >= nbytes]
        if fits:
            return self._buffers.pop(min(fits, key=lambda i: self._buffers[i][0].numel()))
        buf = torch.empty(max(nbytes, _EPOCH_BYTES), dtype=torch.uint8)
        return buf, self._agent.agent.register_memory(buf)

    def _post_epoch_check(self, pend: _Pending, p: int, status: str) -> None:
        """READ prefill rank p's epochs of the request's blocks, after its data; the READ
        carries the notification, which NIXL delivers once the epochs have been read (so the
        prefill side cannot free the blocks before they are checked)."""
        api, (name, md) = self._agent.agent, self.remotes[p]
        blocks = pend.epoch_blocks
        n = len(blocks)
        slot = self.rank_plan.remote_ranks.index(p)
        size = torch.full((n,), _EPOCH_BYTES, dtype=torch.int64)
        local = _nx3(np.array([pend.epochs.data_ptr()], dtype=np.uint64),
                     (slot * n + torch.arange(n)) * _EPOCH_BYTES, size)
        remote = _nx3(np.array([md.block_epochs_addr], dtype=np.uint64),
                      torch.from_numpy(blocks.astype(np.int64)) * _EPOCH_BYTES, size)
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
        got = pend.epochs[:len(remotes) * len(blocks) * _EPOCH_BYTES].view(torch.int64)
        got = got.view(len(remotes), len(blocks))
        epoch = pend.request.epoch
        bad = ((got <= 0) | (got > epoch)).nonzero()
        if len(bad):
            i, j = bad[0].tolist()
            e = int(got[i, j])
            state = ("freed" if e < 0 else "never held" if e == 0 else
                     f"freed and held again by a later lease (epoch {e})")
            del self._pending[pend.request.request_id]
            self._fail(pend, f"prefill rank {remotes[i]} does not hold block {int(blocks[j])} "
                             f"since epoch {epoch}: it was {state} ({len(bad)} block epochs "
                             f"wrong); the bytes read may be another request's KV")

    def _stage(self, staged: list, pend: _Pending) -> None:
        """Whole remote runs -> one registered bounce buffer; copies recorded for the end."""
        g = self.geometry
        total = sum(int(length.sum()) * r_row_bytes * len(r_bases)
                    for _, _, r_bases, r_row_bytes, _, _, length in staged)
        pend.staging, pend.staging_reg = self._take_buffer(total)
        base = np.array([pend.staging.data_ptr()], dtype=np.uint64)
        cursor = 0
        for read, rr, r_bases, r_row_bytes, r_rows, l_rows, length in staged:
            first = torch.cumsum(length, 0) - length
            idx = torch.repeat_interleave(torch.arange(len(length)), length)
            rows = l_rows[idx] + torch.arange(len(idx)) - first[idx]
            size = length * r_row_bytes
            n_bytes = int(size.sum())
            for t, r_base in enumerate(r_bases):
                rr.local.append(_nx3(base, cursor + first * r_row_bytes, size))
                rr.remote.append(_nx3(np.array([r_base], dtype=np.uint64), r_rows * r_row_bytes,
                                       size))
                pend.copies.append(_StagedCopy(
                    tensor=t, staging_offset=cursor, rows=rows,
                    remote_heads=r_row_bytes // g.head_bytes,
                    remote_head_offset=read.remote_head_offset,
                    local_head_offset=read.local_head_offset, num_heads=read.num_heads))
                cursor += n_bytes
            rr.bytes += n_bytes * len(r_bases)


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


def _nx3(bases: np.ndarray, offsets: torch.Tensor, sizes: torch.Tensor) -> np.ndarray:
    """NIXL's Nx3 descriptor array (address, length, device id) for every base x offset."""
    off = offsets.numpy().astype(np.uint64)
    addr = (bases[:, None] + off[None, :]).reshape(-1)
    out = np.zeros((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = np.tile(sizes.numpy().astype(np.uint64), len(bases))
    return out

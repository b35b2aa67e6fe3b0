"""The handshake of the NIXL KV transfer: what a prefill rank advertises and how a decode rank
fetches and checks it (spec: "Disaggregated Inference (NIXL Transfer)":
NeuronNixlAgentMetadata).

Each prefill rank serves its :class:`NeuronNixlAgentMetadata` -- the NIXL agent metadata plus
the spec's ``dcp_size`` extension and the cache geometry -- on a small TCP side channel at
``host:side_channel_port + tp_rank`` (vLLM's NIXL side channel uses the same
base-port-plus-rank convention). Protocol: the client sends ``DCPKV-META 3\\n``, an 8-byte
big-endian length and a sealed hello (:mod:`.auth`: HMAC-SHA256 under the engines' shared
key, a nonce, the sender, the time); the server checks it (a forged, tampered, replayed or
unsigned hello is logged, counted in ``rejected`` and answered with nothing: the metadata,
which is what lets a peer READ the KV, never leaves without the key) and answers an 8-byte
length and the sealed JSON metadata, bound to the hello's nonce (no pickle: the bytes come
from the network). The server runs each client on its own thread (at most 64 at once)
with one deadline for its whole exchange; the client too has one deadline for the whole
handshake (the remaining time is recomputed for every recv) and refuses a length above 1 MiB
before allocating. :func:`check_metadata` compares what a remote rank advertised with what the transfer
plan expects of it. Nothing here imports nixl.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass, replace

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransferError
from dcp_compile.runtime.topology import topology
from dcp_compile.runtime.transfer.nixl.auth import (DCPAuthError, MessageKind, Opener,
                                                     SideChannelKey, seal)

__all__ = ["MAX_MESSAGE", "NeuronNixlAgentMetadata", "SideChannelServer", "agent_name",
           "check_metadata", "fetch_metadata"]

_HELLO = b"DCPKV-META 3\n"
MAX_HELLO = 1 << 12              # bytes a sealed hello may announce
_MD_FORMAT = "dcp-nixl-agent-metadata/2"
MAX_MESSAGE = 1 << 20                # bytes a side-channel message may announce
SIDE_CHANNEL_CLIENT_TIMEOUT = 5.0    # seconds one client's whole exchange may take
SIDE_CHANNEL_MAX_CLIENTS = 64        # exchanges served at once (a thread each)

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


class SideChannelServer:
    """Serves one payload to every client whose sealed hello verifies, each client on its own
    thread.

    A client gets ``client_timeout`` seconds for the whole exchange (one deadline, not one
    per recv), so an idle or trickling client holds one handler thread at most that long and
    never delays another client. At most ``max_clients`` exchanges run at once; a client
    beyond that is closed at once (bounded threads). A hello that does not verify under
    ``key`` is refused: logged, counted (``rejected_count``, ``rejected``: the reasons) and
    answered with nothing.
    """

    def __init__(self, host: str, port: int, payload: bytes, *, key: SideChannelKey,
                 sender: str, client_timeout: float = SIDE_CHANNEL_CLIENT_TIMEOUT,
                 max_clients: int = SIDE_CHANNEL_MAX_CLIENTS):
        self._payload, self._key, self._sender = payload, key, sender
        self._opener = Opener(key)
        self.rejected: collections.deque[str] = collections.deque(maxlen=1000)
        self.rejected_count = 0
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
            if _recv_exact(conn, len(_HELLO), deadline) != _HELLO:
                return self._refuse(conn, "a client that does not speak this protocol")
            (n,) = struct.unpack(">Q", _recv_exact(conn, 8, deadline))
            if n > MAX_HELLO:
                return self._refuse(conn, f"a hello of {n} bytes (at most {MAX_HELLO})")
            raw = _recv_exact(conn, n, deadline)
            try:
                with self._lock:     # one opener: its nonce memory is shared by all clients
                    hello = self._opener.open(raw, MessageKind.HELLO)
            except DCPAuthError as e:
                return self._refuse(conn, str(e))
            answer, _ = seal(self._key, MessageKind.METADATA, self._sender, self._payload,
                             reply_to=hello.nonce)
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.sendall(struct.pack(">Q", len(answer)) + answer)
        except (OSError, ConnectionError):
            pass  # a client that hangs up or stalls is dropped
        finally:
            with self._lock:
                self._clients.discard(conn)
            conn.close()
            self._slots.release()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        peer = _peer(conn)
        with self._lock:
            self.rejected_count += 1
            self.rejected.append(why)
        log.warning("side channel %s (%s): refused %s: %s", self._sock.getsockname(),
                    self._sender, peer, why)

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


def _peer(conn: socket.socket) -> str:
    try:
        return "%s:%s" % conn.getpeername()[:2]
    except OSError:
        return "a peer that left"


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


def fetch_metadata(host: str, port: int, deadline: float, *, key: SideChannelKey, sender: str,
                   what: str = "remote rank", max_message: int = MAX_MESSAGE,
                   listening: bool = False) -> bytes:
    """The side-channel payload at host:port; retries until ``deadline`` (time.monotonic()).

    The whole exchange (connect, sealed hello, length, sealed answer) shares the one deadline.
    A refused connection is retried (the peer may not be listening yet), unless ``listening``
    says the peer is known to have been listening already (e.g. it published a handoff after
    its side channel came up): then a refused connection means its process is gone, and the
    fetch fails at once, naming it, instead of waiting out the deadline.
    A length prefix above ``max_message`` is refused before anything is allocated; an answer
    that does not verify under ``key`` or does not answer this hello is a DCPAuthError.
    """
    last = "no attempt"
    opener = Opener(key)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=left) as conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                hello, nonce = seal(key, MessageKind.HELLO, sender, b"")
                conn.sendall(_HELLO + struct.pack(">Q", len(hello)) + hello)
                (n,) = struct.unpack(">Q", _recv_exact(conn, 8, deadline))
                if n > max_message:
                    raise DCPTransferError(
                        f"{what}: the side channel at {host}:{port} announced a message of {n} "
                        f"bytes, above the limit of {max_message} bytes. Connect to a "
                        f"PrefillKVConnector side channel (its metadata is a few KiB).")
                raw = _recv_exact(conn, n, deadline)
            try:
                return opener.open(raw, MessageKind.METADATA, reply_to=nonce).payload
            except DCPAuthError as e:
                log.warning("%s: refused the side channel's answer at %s:%s: %s", what, host,
                            port, e)
                raise DCPAuthError(f"{what}: the side channel at {host}:{port} answered with "
                                   f"{e}. Give both engines the same key ({_KEY_HINT}).") from None
        except ConnectionRefusedError as e:
            if listening:
                raise DCPTransferError(
                    f"{what} refused the handshake at {host}:{port} ({e}) after its side "
                    f"channel had been listening: its process is gone (the kernel closed its "
                    f"port). Relaunch the prefill engine; its KV must be computed again."
                    ) from None
            last = f"{type(e).__name__}: {e}"
        except (OSError, ConnectionError) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
    raise DCPTransferError(f"{what} did not answer the handshake at {host}:{port} in time "
                           f"(last error: {last}). Check that the prefill engine is running and "
                           f"its side_channel_port, or raise handshake_timeout; a side channel "
                           f"that refuses our hello (another key: {_KEY_HINT}) closes without "
                           f"answering, and is logged on the prefill side.")


_KEY_HINT = "DCP_KV_KEY or DCP_KV_KEY_FILE"


def check_metadata(md: NeuronNixlAgentMetadata, p: int, prefill: DCPConfig, geometry, *,
                   decode_rank: int) -> None:
    """Refuse metadata of prefill rank ``p`` that does not match the plan: its rank, degrees,
    KV heads and cache geometry must be what ``prefill`` and the decode rank's own
    ``geometry`` (a :class:`dcp_compile.runtime.transfer.nixl.descriptors.CacheGeometry`) imply."""
    g, pc = geometry, prefill
    remote_heads = tuple(topology(pc.tp, pc.dcp, pc.mode, config=pc).kv_heads_of(p))
    remote = replace(g, block_size=pc.block_size, num_heads=len(remote_heads))
    expect = {
        "tp_rank": (md.tp_rank, p), "tp_size": (md.tp_size, pc.tp),
        "dcp_size": (md.effective_dcp, pc.dcp), "kv_heads": (md.kv_heads, remote_heads),
        "block_size": (md.block_size, pc.block_size), "head_dim": (md.head_dim, g.head_dim),
        "dtype": (md.dtype, str(g.dtype).replace("torch.", "")),
        "num_layers": (len(md.kv_caches_base_addr), g.num_layers),
        "block_len": (md.block_len, remote.block_len),
    }
    wrong = [f"{k} advertised {got!r}, plan expects {want!r}"
             for k, (got, want) in expect.items() if got != want]
    if md.num_blocks < 2:
        wrong.append(f"num_blocks advertised {md.num_blocks}, needs >= 2")
    if wrong:
        raise DCPTransferError(
            f"decode rank {decode_rank}: handshake metadata of prefill rank {p} "
            f"({md.agent_name}, engine {md.engine_id!r}) does not match the transfer plan "
            f"(prefill TP={pc.tp}/DCP={pc.dcp}): {'; '.join(wrong)}. Plan with the prefill "
            f"engine's real layout, or connect to the right engine.")

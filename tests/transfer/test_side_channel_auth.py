"""The authenticated side channel (runtime/transfer/nixl/auth.py, issue #39 item 2): a rogue
local client (a thread on 127.0.0.1 only) tries each message type -- the hello that asks for
the agent metadata, the metadata answer (a rogue server), the notification that ends a
lease -- with no key, the wrong key, a replay of a captured valid message and a tampered
payload. Each is refused, logged and counted, and the metadata (what lets a peer READ the
KV) never leaves without the key. An engine without a key does not start unless the
insecure local mode is asked for, which logs a warning.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import pytest
import torch

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.transfer.nixl import auth
from dcp_compile.runtime.transfer.nixl.auth import (DCPAuthError, MessageKind, Opener,
                                                     load_key, seal)
from dcp_compile.runtime.transfer.nixl.handshake import (_HELLO, SideChannelServer,
                                                          fetch_metadata)

HOST = "127.0.0.1"          # loopback only
BOUND = 3.0
KEY = load_key("k" * 32)
OTHER = load_key("o" * 32)
PAYLOAD = b'{"the": "agent metadata"}'


@pytest.fixture
def server():
    from dcp_compile.runtime.distributed.launch import free_port_base
    port = free_port_base(1)
    s = SideChannelServer(HOST, port, PAYLOAD, key=KEY, sender="pre-rank0", client_timeout=BOUND)
    yield s, port
    s.close()


def _exchange(port: int, data: bytes) -> bytes:
    """What the server answers a rogue client that sends ``data`` (b"": it closed)."""
    with socket.create_connection((HOST, port), timeout=BOUND) as conn:
        conn.sendall(data)
        out = bytearray()
        while chunk := conn.recv(1 << 16):
            out += chunk
        return bytes(out)


def _hello(sealed: bytes) -> bytes:
    return _HELLO + struct.pack(">Q", len(sealed)) + sealed


class _Recorder:
    """A loopback proxy between an honest client and the server that keeps a copy of what
    the client sent and what the server answered: the capture a replay starts from."""

    def __init__(self, port: int):
        self.sock = socket.create_server((HOST, 0))
        self.port, self.target = self.sock.getsockname()[1], port
        self.sent, self.answered = bytearray(), bytearray()
        threading.Thread(target=self._one, daemon=True).start()

    def _one(self):
        conn, _ = self.sock.accept()
        with conn, socket.create_connection((HOST, self.target), timeout=BOUND) as up:
            conn.settimeout(BOUND)
            self.sent += conn.recv(1 << 16)
            while len(self.sent) < len(_HELLO) + 8 or len(self.sent) < len(_HELLO) + 8 + \
                    struct.unpack(">Q", self.sent[len(_HELLO):len(_HELLO) + 8])[0]:
                self.sent += conn.recv(1 << 16)
            up.sendall(self.sent)
            while chunk := up.recv(1 << 16):
                self.answered += chunk
            conn.sendall(self.answered)
        self.sock.close()


def _captured(port: int) -> tuple[bytes, bytes]:
    """An honest client's hello and the server's answer to it, through the recorder."""
    rec = _Recorder(port)
    assert fetch_metadata(HOST, rec.port, time.monotonic() + BOUND, key=KEY,
                          sender="dec-rank0") == PAYLOAD
    return bytes(rec.sent), bytes(rec.answered)


def _tamper(sealed: bytes, field: str, value) -> bytes:
    body, _, mac = sealed.rpartition(b"\n")
    d = json.loads(body)
    d[field] = value
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode() + b"\n" + mac


def _forged_hellos(port: int) -> dict:
    hello, _ = _captured(port)
    sealed = hello[len(_HELLO) + 8:]
    return {
        "no key (the previous protocol)": (b"DCPKV-META 2\n",
                                           "does not speak this protocol"),
        "no key (no MAC)": (_hello(seal(KEY, MessageKind.HELLO, "rogue", b"")[0]
                                   .rpartition(b"\n")[0] + b"\n"), "MAC does not verify"),
        "no key (no seal)": (_hello(b'{"want": "metadata"}'), "without a seal"),
        "wrong key": (_hello(seal(OTHER, MessageKind.HELLO, "rogue", b"")[0]),
                      "MAC does not verify"),
        "replay": (hello, "nonce was seen before: a replay"),
        "tampered": (_hello(_tamper(sealed, "sender", "rogue")), "MAC does not verify"),
        "another kind": (_hello(seal(KEY, MessageKind.NOTIFICATION, "dec-rank0", b"")[0]),
                         "'notification' message where a hello was expected"),
        "huge": (_HELLO + struct.pack(">Q", 2 ** 40), "a hello of 1099511627776 bytes"),
    }


@pytest.mark.parametrize("attempt", ["no key (the previous protocol)", "no key (no MAC)",
                                     "no key (no seal)", "wrong key", "replay", "tampered",
                                     "another kind", "huge"])
def test_a_rogue_hello_gets_no_metadata_and_is_logged(server, attempt, caplog):
    s, port = server
    data, reason = _forged_hellos(port)[attempt]
    before = s.rejected_count
    with caplog.at_level(logging.WARNING):
        assert _exchange(port, data) == b""          # not one byte of the metadata
        deadline = time.monotonic() + BOUND
        while s.rejected_count == before and time.monotonic() < deadline:
            time.sleep(0.01)
    assert s.rejected_count == before + 1 and reason in s.rejected[-1], list(s.rejected)
    assert any(reason in r.getMessage() and "refused 127.0.0.1:" in r.getMessage()
               for r in caplog.records)
    # The honest client is still served.
    assert fetch_metadata(HOST, port, time.monotonic() + BOUND, key=KEY,
                          sender="dec-rank0") == PAYLOAD


class _RogueServer:
    """A loopback server that answers every hello with ``answer`` (a captured or forged one)."""

    def __init__(self, answer: bytes):
        self.sock = socket.create_server((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        self.sock.settimeout(0.1)
        while True:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.recv(1 << 16)
                conn.sendall(self.answer)


@pytest.mark.parametrize("attempt", ["replayed answer", "wrong key", "tampered", "no MAC"])
def test_a_rogue_metadata_answer_is_refused_by_the_decode_side(server, attempt):
    _, port = server
    _, answer = _captured(port)
    sealed = answer[8:]
    forged = {"replayed answer": sealed,
              "wrong key": seal(OTHER, MessageKind.METADATA, "pre-rank0", b"{}")[0],
              "tampered": _tamper(sealed, "payload", "e30="),
              "no MAC": sealed.rpartition(b"\n")[0] + b"\n"}[attempt]
    rogue = _RogueServer(struct.pack(">Q", len(forged)) + forged)
    reason = {"replayed answer": "answers another request",
              "wrong key": "MAC does not verify", "tampered": "MAC does not verify",
              "no MAC": "MAC does not verify"}[attempt]
    try:
        with pytest.raises(DCPAuthError, match=rf"side channel at 127\.0\.0\.1:{rogue.port} "
                                               rf"answered with .*{reason}.*same key"):
            fetch_metadata(HOST, rogue.port, time.monotonic() + BOUND, key=KEY,
                           sender="dec-rank0")
    finally:
        rogue.sock.close()


def test_notifications_are_opened_once_and_only_under_the_key():
    """The notification's checks, message by message (the NIXL path is
    test_nixl_faults.py::test_rogue_notifications_are_refused_and_logged)."""
    opener = Opener(KEY)
    good, _ = seal(KEY, MessageKind.NOTIFICATION, "dec-rank0", b'{"req": "R"}')
    assert opener.open(good, MessageKind.NOTIFICATION).payload == b'{"req": "R"}'
    refused = {
        "replay": (good, "seen before: a replay"),
        "wrong key": (seal(OTHER, MessageKind.NOTIFICATION, "dec-rank0", b"{}")[0],
                      "MAC does not verify"),
        "tampered": (_tamper(good, "payload", "e30="), "MAC does not verify"),
        "unsigned": (b'{"req": "R"}', "without a seal"),
        "another kind": (seal(KEY, MessageKind.HELLO, "dec-rank0", b"")[0],
                         "'hello' message where a notification was expected"),
    }
    for name, (raw, reason) in refused.items():
        with pytest.raises(DCPAuthError, match=reason):
            opener.open(raw, MessageKind.NOTIFICATION)


def test_a_message_too_old_is_refused_even_with_a_fresh_nonce(monkeypatch):
    sealed, _ = seal(KEY, MessageKind.NOTIFICATION, "dec-rank0", b"{}")
    later = time.time() + auth.MAX_AGE + 1
    monkeypatch.setattr(auth.time, "time", lambda: later)
    with pytest.raises(DCPAuthError, match=r"sealed 3\d\.\d s ago .*stale or replayed"):
        Opener(KEY).open(sealed, MessageKind.NOTIFICATION)


# -- the key -----------------------------------------------------------------------------


@pytest.fixture
def no_key(monkeypatch):
    for name in (auth.KEY_ENV, auth.KEY_FILE_ENV, auth.INSECURE_ENV):
        monkeypatch.delenv(name, raising=False)


def _prefill(**kw):
    from dcp_compile.runtime.transfer.nixl.connector import PrefillKVConnector
    cfg = DCPConfig(tp=1, dcp=1, mode="prefill", block_size=4, num_q_heads=2, num_kv_heads=2,
                    head_dim=8)
    caches = [(torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))]
    return PrefillKVConnector(cfg, 0, caches, side_channel_port=1, **kw)


def test_an_engine_without_a_key_does_not_start(no_key):
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector
    with pytest.raises(DCPAuthError, match=r"prefill rank 0: the KV side channel needs a key "
                                           r"shared by the prefill and decode engines.*"
                                           r"DCP_KV_KEY.*insecure=True"):
        _prefill()
    cfg = DCPConfig(tp=1, dcp=1, mode="prefill", block_size=4, num_q_heads=2,
                    num_kv_heads=2, head_dim=8)
    with pytest.raises(DCPAuthError, match=r"decode rank 0: the KV side channel needs a key"):
        DecodeKVConnector(cfg, DCPConfig(tp=1, dcp=1, mode="decode", block_size=4,
                                         num_q_heads=2, num_kv_heads=2, head_dim=8), 0,
                          [(torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))],
                          side_channel_port=1)


def test_the_insecure_local_mode_is_explicit_and_logged(no_key, caplog):
    with caplog.at_level(logging.WARNING):
        key = load_key(insecure=True, who="prefill rank 0")
    assert key.insecure
    assert any("insecure local mode" in r.getMessage() and "any process that reaches its port"
               in r.getMessage() for r in caplog.records)
    # A secure receiver refuses what an insecure sender seals (no MAC).
    with pytest.raises(DCPAuthError, match="MAC does not verify"):
        Opener(KEY).open(seal(key, MessageKind.HELLO, "x", b"")[0], MessageKind.HELLO)


@pytest.mark.parametrize("source, match", [
    ("short", r"has 5 bytes; at least 32 are needed"),
    ("open-file", r"is readable by others \(mode -rw-r--r--\)\. chmod 600 it"),
    ("missing-file", r"cannot be read"),
])
def test_a_weak_or_exposed_key_is_refused(no_key, monkeypatch, tmp_path, source, match):
    if source == "short":
        monkeypatch.setenv(auth.KEY_ENV, "short")
    else:
        path = tmp_path / "key"
        if source == "open-file":
            path.write_text("k" * 40)
            path.chmod(0o644)
        monkeypatch.setenv(auth.KEY_FILE_ENV, str(path))
    with pytest.raises(DCPAuthError, match=match):
        load_key()


def test_a_key_file_readable_by_its_owner_only_is_used(no_key, monkeypatch, tmp_path):
    path = tmp_path / "key"
    path.write_text("k" * 32 + "\n")
    path.chmod(0o600)
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(path))
    key = load_key()
    sealed, _ = seal(key, MessageKind.HELLO, "x", b"")
    assert Opener(KEY).open(sealed, MessageKind.HELLO).sender == "x"   # the same key

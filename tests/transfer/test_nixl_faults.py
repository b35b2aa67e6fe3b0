"""Fault injection on the NIXL KV transfer (runtime/transfer/nixl/connector.py): each fault ends in a
DCPTransferError within its bound, or is ignored and counted, never in a completion.

Prefill and decode agents share this process (UCX over tcp on 127.0.0.1) and the test drives
their progress by hand, so every interleaving below is forced, not raced; only the killed
peer runs in a subprocess (marked multiprocess). Bounds are generous (seconds) and asserted
only as upper bounds.
"""

from __future__ import annotations

import json
import os
import logging
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPTransferError

from suite_path import ROOT  # noqa: E402  (the repository root)
BLOCK, HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 8, 6   # 5 usable blocks + the garbage block
SEQ = 7                                            # two blocks of the prefill table
BOUND = 2.0                                        # seconds a failure may take
# The timing asserts show the failure came from BOUND, not from the peer's own 30 s of
# trickling or silence; the slack is wide so that a loaded machine cannot fail them.
SLACK = 15.0
DRIVE = 20.0                                       # seconds a forced interleaving may take


@pytest.fixture(scope="module", autouse=True)
def loopback_ucx():
    try:
        from dcp_compile.runtime.transfer.nixl.build import nixl_api
        nixl_api()
    except Exception as e:  # the wheel raises ImportError, or RuntimeError without a backend
        pytest.skip(f"import nixl failed: {type(e).__name__}: {e}")
    saved = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES", "NIXL_LOG_LEVEL")}
    from dcp_compile.runtime.distributed.launch import loopback_env
    os.environ.update({k: v for k, v in loopback_env().items() if k in saved})
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _cfg(tp: int, mode: str) -> DCPConfig:
    return DCPConfig(tp=tp, dcp=1, mode=mode, block_size=BLOCK, num_kv_heads=HEADS)


def _caches(heads: int, fill=None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK, heads, HEAD_DIM)
    if fill is not None:
        return [(torch.full(shape, fill), torch.full(shape, fill))]
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))]


@pytest.fixture
def engines():
    """A TP=1 prefill rank and a TP=2 decode engine (each decode rank reads one head of it:
    both are planned readers of prefill rank 0), on 127.0.0.1, handshaken."""
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, PrefillKVConnector
    from dcp_compile.runtime.distributed.launch import free_port_base

    port = free_port_base(1)
    freed = []
    pre = PrefillKVConnector(_cfg(1, "prefill"), 0, _caches(HEADS, seed=1), engine_id="pre",
                             side_channel_port=port,
                             on_free=lambda rid, blocks: freed.append((rid, blocks)))
    decs = [DecodeKVConnector(_cfg(1, "prefill"), _cfg(2, "decode"), d, _caches(1, fill=-7.0),
                              engine_id="dec", side_channel_port=port, handshake_timeout=DRIVE,
                              transfer_timeout=BOUND) for d in range(2)]
    for d in decs:
        _handshake(pre, d)
    yield pre, decs, freed
    for d in decs:
        d.close()
    pre.close()


def _handshake(pre, dec):
    """dec.handshake() while the prefill side polls (its probe READ needs prefill progress)."""
    stop = threading.Event()

    def poll():  # only during the handshake: poll() and the test never run at once
        while not stop.is_set():
            pre.poll()
            time.sleep(0.001)
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        dec.handshake()
    finally:
        stop.set()
        t.join()


def _drive(pre, decs, until, what: str):
    """Progress both sides (prefill poll, decode get_finished) until ``until()``."""
    deadline = time.monotonic() + DRIVE
    while not until():
        assert time.monotonic() < deadline, f"not within {DRIVE} s: {what}"
        pre.poll()
        for d in decs:
            d._agent.agent.get_new_notifs()  # progresses the decode agent too
            if d._pending:
                try:
                    d.get_finished()
                except DCPTransferError:
                    pass  # recorded in d.failed
        time.sleep(0.001)


def _read(pre, decs, request):
    """Every decode rank reads ``request``; rank -> "finished" or its error message."""
    for d in decs:
        d.start_read(request)
    rid = request.request_id
    _drive(pre, decs, lambda: all(rid in d.finished_stats or rid in d.failed for d in decs),
           f"read of {rid}")
    return {d.rank: "finished" if rid in d.finished_stats else d.failed[rid] for d in decs}


def _write_request(pre, blocks, seed):
    """What a prefill of another request does to its blocks: new KV in every layer."""
    g = torch.Generator().manual_seed(seed)
    for kv in pre._agent.caches:
        kv[blocks] = torch.randn(kv[blocks].shape, generator=g)


def _assert_holds(pre, dec, request, d_table):
    """The decode rank's rows equal the prefill's rows of its head, position by position."""
    head = dec.rank  # TP=2 decode of 2 KV heads: rank d holds head d
    for src, dst in zip(pre._agent.caches, dec._agent.caches):
        want = src[request.prefill_block_table].reshape(-1, HEADS, HEAD_DIM)[:request.seq_len]
        got = dst[d_table].reshape(-1, 1, HEAD_DIM)[:request.seq_len]
        assert torch.equal(got[:, 0], want[:, head])


READERS = [("dec", 0), ("dec", 1)]


# ---------------------------------------------------------------------------------------
# Freed and reused blocks
# ---------------------------------------------------------------------------------------


def test_read_after_deadline_freed_and_reused_blocks_fails_never_completes(engines):
    from dcp_compile.runtime.transfer.nixl.connector import TransferRequest
    pre, decs, freed = engines
    epoch_a = pre.hold("A", [0, 1], READERS, timeout=0.2)
    _drive(pre, [], lambda: "A" in pre.released, "lease A expiring")
    assert freed == [("A", [0, 1])]
    with pytest.raises(DCPTransferError, match=r"'A' \(epoch 1\) expired before readers"):
        pre.wait_for_readers("A")
    _write_request(pre, [0, 1], seed=5)             # the allocator reuses the blocks for B
    epoch_b = pre.hold("B", [0, 1], READERS, timeout=DRIVE)
    assert epoch_b > epoch_a

    late = _read(pre, decs, TransferRequest("A", SEQ, [0, 1], [2, 3], epoch_a))
    for msg in late.values():
        assert "does not hold block 0 since epoch 1" in msg
        assert "freed and held again by a later lease" in msg and "must not be used" in msg
    assert all("A" not in d.finished_stats for d in decs)
    assert any(r.request_id == "A" and "is not held" in r.reason for r in pre.rejected)

    # The same reads against B's lease complete, with B's KV (the check can pass).
    ok = _read(pre, decs, TransferRequest("B", SEQ, [0, 1], [2, 3], epoch_b))
    assert ok == {0: "finished", 1: "finished"}
    for d in decs:
        _assert_holds(pre, d, TransferRequest("B", SEQ, [0, 1], [2, 3], epoch_b), [2, 3])
    _drive(pre, decs, lambda: "B" in pre.released, "lease B ending")  # notifs in flight
    assert pre.released["B"].outcome == "read" and freed[-1] == ("B", [0, 1])


def test_blocks_freed_and_reused_between_data_and_epoch_read_fail(engines, monkeypatch):
    """The race the epoch check exists for: data read, then the prefill side frees the blocks
    and writes another request into them before the decode side checks."""
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest
    pre, decs, freed = engines
    epoch_a = pre.hold("A", [3, 4], READERS, timeout=DRIVE)
    post = DecodeKVConnector._post_epoch_check
    reused = []

    def reuse_then_check(self, pend, p, status):
        if not reused:  # first data READ done: cancel A, reuse its blocks for B
            pre.release("A")
            _write_request(pre, [3, 4], seed=9)
            reused.append(pre.hold("B", [3, 4], READERS, timeout=DRIVE))
        return post(self, pend, p, status)

    monkeypatch.setattr(DecodeKVConnector, "_post_epoch_check", reuse_then_check)
    out = _read(pre, decs, TransferRequest("A", SEQ, [3, 4], [0, 1], epoch_a))
    assert reused and freed[0] == ("A", [3, 4])
    for msg in out.values():
        assert f"does not hold block 3 since epoch {epoch_a}" in msg
    assert all("A" not in d.finished_stats for d in decs)


def test_never_held_blocks_or_missing_epoch_fail(engines):
    from dcp_compile.runtime.transfer.nixl.connector import TransferRequest
    pre, decs, _ = engines
    pre.hold("A", [0], READERS, timeout=DRIVE)
    # Blocks 2, 3 were never held: a made-up (large) epoch does not pass the check.
    out = _read(pre, decs, TransferRequest("X", SEQ, [2, 3], [0, 1], 10**9))
    assert all("it was never held" in m for m in out.values())
    with pytest.raises(DCPTransferError, match="has epoch None"):
        decs[0].start_read(TransferRequest("Y", SEQ, [0, 1], [0, 1], None))


def test_hold_refuses_bad_leases(engines):
    pre, _, _ = engines
    pre.hold("A", [0, 1], READERS, timeout=DRIVE)
    bad = [(("A", [2], READERS), {}, "already held"),
           (("B", [5], READERS), {}, r"out of range \[5\]"),
           (("B", [2, 2], READERS), {}, "some twice"),
           (("B", [2], []), {}, "has no readers"),
           (("B", [2], READERS), {"epoch": 1}, "does not exceed the last issued 1")]
    for args, kw, match in bad:
        with pytest.raises(DCPTransferError, match=match):
            pre.hold(*args, timeout=DRIVE, **kw)
    assert list(pre.leases) == ["A"]


# ---------------------------------------------------------------------------------------
# Spoofed notifications
# ---------------------------------------------------------------------------------------


def test_spoofed_notifications_are_ignored_and_counted(engines):
    from dcp_compile.runtime.transfer.nixl.auth import MessageKind, seal
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest
    pre, decs, freed = engines
    epoch = pre.hold("R", [2], READERS, timeout=DRIVE)
    intruder = DecodeKVConnector(_cfg(1, "prefill"), _cfg(1, "decode"), 0,
                                 _caches(HEADS, fill=0.0), engine_id="intruder",
                                 side_channel_port=pre.side_channel[1],
                                 handshake_timeout=DRIVE)
    try:
        _handshake(pre, intruder)

        def notif(**kw):
            n = {"req": "R", "epoch": epoch, "engine": "dec", "rank": 0, "status": "read"}
            return json.dumps({**n, **kw}).encode()
        spoofs = [  # (sender, payload, the reason it is ignored)
            (decs[1], notif(rank=0), "sent by agent 'dec-rank1', but reader ('dec', 0) is "
                                     "agent 'dec-rank0'"),
            (decs[0], notif(req="R2"), "request 'R2' is not held"),
            (decs[0], notif(epoch=epoch + 1), f"epoch {epoch + 1} is not the lease's"),
            (decs[0], notif(status="done"), "status 'done' is not one of"),
            (intruder, notif(), "sent by agent 'intruder-rank0'"),
            (intruder, notif(engine="intruder"), "reader ('intruder', 0) is not one the plan"),
            (intruder, b"\xff not json", "not a readable notification"),
        ]
        for sender, payload, _ in spoofs:   # insiders: sealed under the engines' key
            sealed, _ = seal(sender.key, MessageKind.NOTIFICATION, sender._agent.name, payload)
            sender._agent.agent.send_notif(sender.remotes[0][0], sealed)
        _drive(pre, decs + [intruder], lambda: pre.rejected_count >= len(spoofs), "spoofs")
        got = sorted(r.reason for r in pre.rejected)
        for _, _, reason in spoofs:
            assert sum(reason in g for g in got) == 1, (reason, got)
        assert pre.rejected_count == len(spoofs)
        assert "R" in pre.leases and not pre.leases["R"].notified
        assert "R" not in pre.notifications and freed == []
    finally:
        intruder.close()
    # The planned readers complete the lease.
    out = _read(pre, decs, TransferRequest("R", 2, [2], [4], epoch))
    assert out == {0: "finished", 1: "finished"}
    _drive(pre, decs, lambda: "R" in pre.released, "lease R ending")
    assert pre.wait_for_readers("R") == {("dec", 0): "read", ("dec", 1): "read"}
    assert freed == [("R", [2])] and pre.rejected_count == len(spoofs)


def _taken(pre) -> int:
    """Notifications the prefill side has taken (refused, or accepted for lease R)."""
    return pre.rejected_count + len(pre.leases["R"].notified)


def test_rogue_notifications_are_refused_and_logged(engines, caplog):
    """A rogue NIXL peer (it learned the metadata: here by handshaking with the key) sends
    notifications unsealed, sealed with another key, a captured valid one (replayed, by its
    reader and by the rogue) and a tampered copy: each is refused and logged; the captured
    one counts once."""
    import base64
    from dcp_compile.runtime.transfer.nixl.auth import MessageKind, load_key, seal
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest
    pre, decs, freed = engines
    epoch = pre.hold("R", [2], READERS, timeout=DRIVE)
    rogue = DecodeKVConnector(_cfg(1, "prefill"), _cfg(1, "decode"), 0,
                              _caches(HEADS, fill=0.0), engine_id="rogue",
                              side_channel_port=pre.side_channel[1], handshake_timeout=DRIVE)
    try:
        _handshake(pre, rogue)
        plain = json.dumps({"req": "R", "epoch": epoch, "engine": "dec", "rank": 0,
                            "status": "read"}).encode()
        captured = decs[0]._notif(TransferRequest("R", 2, [2], [4], epoch), "read")
        body, _, mac = captured.rpartition(b"\n")
        fields = json.loads(body)
        fields["payload"] = base64.b64encode(plain.replace(b'"rank": 0', b'"rank": 1')).decode()
        tampered = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode() + \
            b"\n" + mac
        other = load_key("o" * 32)
        attempts = [  # (sender, bytes, the reason it is refused)
            (rogue, plain, "without a seal"),
            (rogue, seal(other, MessageKind.NOTIFICATION, "dec-rank0", plain)[0],
             "MAC does not verify"),
            (rogue, captured, "sealed by 'dec-rank0', sent by agent 'rogue-rank0'"),
            (decs[0], captured, None),                       # the reader's own: accepted
            (decs[0], captured, "nonce was seen before: a replay"),
            (decs[1], tampered, "MAC does not verify"),
        ]
        with caplog.at_level(logging.WARNING):
            for sender, raw, _ in attempts:
                sender._agent.agent.send_notif(sender.remotes[0][0], raw)
                before = _taken(pre)
                _drive(pre, decs + [rogue], lambda: _taken(pre) > before, "a notification")
        reasons = [r.reason for r in pre.rejected]
        want = [reason for _, _, reason in attempts if reason]
        assert len(reasons) == len(want) and all(w in g for w, g in zip(want, reasons)), reasons
        assert sum("ignored a notification" in r.getMessage() for r in caplog.records) == len(want)
        assert pre.leases["R"].notified == {("dec", 0): "read"}    # once, from its reader
    finally:
        rogue.close()
    pre.release("R")


# ---------------------------------------------------------------------------------------
# Side channel: trickling peer, huge length prefix, idle clients
# ---------------------------------------------------------------------------------------


class _FakeSideChannel:
    """A server on 127.0.0.1 that reads the hello and answers ``answer(conn)``."""

    def __init__(self, answer):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.answer = answer
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            try:
                conn.recv(64)
                self.answer(conn, self.stop)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.sock.close()


def _client_and_server():
    from dcp_compile.runtime.transfer.nixl.auth import load_key
    return {"key": load_key(), "sender": "test-client"}, {"key": load_key(), "sender": "test-server"}


_CLIENT, _SERVER = _client_and_server()


def _trickle(conn, stop):
    """A valid length prefix and payload, one byte every 0.2 s (minutes in all)."""
    for b in struct.pack(">Q", 1000) + b"x" * 1000:
        if stop.wait(0.2):
            return
        conn.sendall(bytes([b]))


def _huge(conn, stop):
    conn.sendall(struct.pack(">Q", 2**40))
    stop.wait(30)


def test_trickling_peer_fails_within_the_whole_exchange_deadline():
    from dcp_compile.runtime.transfer.nixl.connector import fetch_metadata
    fake = _FakeSideChannel(_trickle)
    try:
        t0 = time.monotonic()
        with pytest.raises(DCPTransferError, match="did not answer the handshake .* in time"):
            fetch_metadata("127.0.0.1", fake.port, time.monotonic() + BOUND, **_CLIENT)
        assert time.monotonic() - t0 < BOUND + SLACK
    finally:
        fake.close()


def test_trickling_peer_bounds_the_connector_handshake():
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector
    fake = _FakeSideChannel(_trickle)
    dec = DecodeKVConnector(_cfg(1, "prefill"), _cfg(1, "decode"), 0, _caches(HEADS, fill=0.0),
                            engine_id="dec", side_channel_port=fake.port,
                            handshake_timeout=BOUND)
    try:
        t0 = time.monotonic()
        with pytest.raises(DCPTransferError, match="did not answer the handshake"):
            dec.handshake()
        assert time.monotonic() - t0 < BOUND + SLACK
    finally:
        dec.close()
        fake.close()


def test_huge_length_prefix_is_refused_before_allocating():
    from dcp_compile.runtime.transfer.nixl.handshake import MAX_MESSAGE, fetch_metadata
    fake = _FakeSideChannel(_huge)
    try:
        t0 = time.monotonic()
        with pytest.raises(DCPTransferError) as e:
            fetch_metadata("127.0.0.1", fake.port, time.monotonic() + BOUND, **_CLIENT)
        assert f"a message of {2**40} bytes, above the limit of {MAX_MESSAGE} bytes" in str(e.value)
        assert time.monotonic() - t0 < BOUND + SLACK
    finally:
        fake.close()


def test_idle_clients_do_not_hold_the_side_channel():
    from dcp_compile.runtime.transfer.nixl.connector import PrefillKVConnector, fetch_metadata
    from dcp_compile.runtime.distributed.launch import free_port_base
    port = free_port_base(1)
    # Idle clients would be dropped after 60 s: far beyond this test's handshake deadline.
    with PrefillKVConnector(_cfg(1, "prefill"), 0, _caches(HEADS), side_channel_port=port,
                            side_channel_client_timeout=60.0) as pre:
        idle = [socket.create_connection(pre.side_channel, timeout=BOUND) for _ in range(3)]
        idle[0].sendall(b"DCPKV")  # half a hello
        try:
            raw = fetch_metadata(*pre.side_channel, time.monotonic() + BOUND, **_CLIENT)
            assert raw == pre.metadata.serialize()
        finally:
            for s in idle:
                s.close()


def test_side_channel_drops_a_client_at_its_deadline_and_beyond_its_capacity():
    from dcp_compile.runtime.transfer.nixl.handshake import SideChannelServer, fetch_metadata
    from dcp_compile.runtime.distributed.launch import free_port_base
    port = free_port_base(1)
    server = SideChannelServer("127.0.0.1", port, b"payload", client_timeout=0.5,
                               max_clients=1, **_SERVER)
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=3 * BOUND)
        time.sleep(0.1)  # let the server take it (its one slot)
        extra = socket.create_connection(("127.0.0.1", port), timeout=3 * BOUND)
        assert extra.recv(1) == b""   # over capacity: closed at once, no thread
        assert idle.recv(1) == b""    # its 0.5 s deadline: closed
        assert fetch_metadata("127.0.0.1", port, time.monotonic() + BOUND,
                              **_CLIENT) == b"payload"
        idle.close()
        extra.close()
    finally:
        server.close()


# ---------------------------------------------------------------------------------------
# Peer killed mid-transfer
# ---------------------------------------------------------------------------------------


@pytest.mark.multiprocess  # a prefill process (~5 s to start)
def test_prefill_killed_mid_transfer_is_an_error_never_a_completion(tmp_path):
    """A prefill process holds a request; the decode side posts its READs, the process is
    killed (SIGKILL) before the reads are checked: the request fails within its bound."""
    from dcp_compile.runtime.transfer.nixl.connector import DecodeKVConnector, TransferRequest
    from dcp_compile.runtime.distributed.launch import free_port_base, loopback_env
    from nixl_loopback import block_tables, engine_config, new_caches, request_epoch
    spec = {"num_kv_heads": HEADS, "head_dim": HEAD_DIM, "layers": 2, "dtype": "float32",
            "block_size": BLOCK, "seed": 0, "timeout": 120,
            "prefill": [{"engine_id": "pK", "tp": 1, "dcp": 1, "port": free_port_base(1)}],
            "decode": [{"engine_id": "dK", "prefill": "pK", "tp": 1, "dcp": 1}],
            "requests": [{"id": "r", "seq_len": 29}],
            "stop_file": str(tmp_path / "never")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.nixl_loopback", "prefill",
                             str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
                            cwd=ROOT, env=loopback_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    p_cfg = engine_config(spec, spec["prefill"][0], "prefill")
    d_cfg = engine_config(spec, spec["decode"][0], "decode")
    _, p_tables = block_tables(spec, p_cfg, "pK")
    num_blocks, d_tables = block_tables(spec, d_cfg, "dK")
    dec = DecodeKVConnector(p_cfg, d_cfg, 0, new_caches(spec, d_cfg, 0, num_blocks),
                            engine_id="dK", side_channel_port=spec["prefill"][0]["port"],
                            handshake_timeout=120, transfer_timeout=BOUND)
    try:
        dec.handshake()  # the process is up and serving (bounded by its start-up)
        dec.start_read(TransferRequest("r", 29, p_tables["r"], d_tables["r"],
                                       request_epoch(spec, 0, 0)))
        proc.kill()
        proc.wait(timeout=60)
        t0 = time.monotonic()
        with pytest.raises(DCPTransferError, match="must not be used"):
            dec.wait("r")
        assert time.monotonic() - t0 < BOUND + SLACK
        assert "r" not in dec.finished_stats and "r" in dec.failed
    finally:
        dec.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_refused_handshake_fails_at_once_when_the_peer_was_listening():
    """A side channel known to have been up (``listening=True``: the prefill side published
    its handoff after it came up) that now refuses the connection is a dead process: named at
    once, not retried to the deadline. Without ``listening`` a refusal is retried (a peer not
    yet listening) until the deadline."""
    from dcp_compile.runtime.distributed.launch import free_port
    from dcp_compile.runtime.transfer.nixl.connector import fetch_metadata
    port = free_port()                                   # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(DCPTransferError, match=r"prefill rank 1 refused the handshake at "
                                               rf"127\.0\.0\.1:{port} .*its process is gone"):
        fetch_metadata("127.0.0.1", port, time.monotonic() + 60, what="prefill rank 1",
                       listening=True, **_CLIENT)
    assert time.monotonic() - t0 < 30                    # not the 60 s deadline
    with pytest.raises(DCPTransferError, match="did not answer the handshake .* in time "
                                               r"\(last error: ConnectionRefusedError"):
        fetch_metadata("127.0.0.1", port, time.monotonic() + BOUND, listening=False,
                       **_CLIENT)

"""Resume after a rank loss (issue 39, item 1): dcp_compile.workers.supervise runs a tp=4/dcp=2
decode world, or a prefill-mode world (``--mode prefill``: sequence-parallel prefill steps), of
the demo model; ranks are killed (SIGKILL) or stopped (SIGSTOP, a hang) at random steps, and
every request still ends with the uninterrupted single-device tokens.

The slice: one supervised decode generation that loses two worlds -- a rank killed from
outside through ``--pids`` while the world starts, and a rank that SIGKILLs itself at a random
step -- and one prefill-mode generation (tp=2/dcp=2: two processes start faster on two cores)
that loses one rank by SIGKILL at a random step. The full run (``DCP_RESUME_FULL=1``): 20
decode losses in a row, every fifth a SIGSTOP hang, and 8 prefill-mode losses on tp=4/dcp=2,
every fourth a hang (a hang costs STEP_TIMEOUT of waiting, so it is there, not here). Nothing
here asserts a time: the timeouts only bound a hang.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from dcp_compile.runtime.errors import DCPInputError, DCPWorldError
from dcp_compile.workers import supervise
from dcp_compile.workers.resumable import RESUMES, Fault, resume_contexts

from full_runs import full
from helpers import single_device_reference
from suite_path import ROOT  # noqa: E402  (the repository root)

LENGTHS = [1, 31, 33, 32]     # an empty shard, lengths around the interleave period (16 x 2)
WORLD, DCP = 4, 2
# Seconds without a finished step before a world counts as hung: generous (a demo-model
# decode step takes milliseconds), it only bounds the SIGSTOP cases.
STEP_TIMEOUT = 20.0


def _supervise(tmp_path, steps, faults, *, external_kill=None, timeout=1800, mode="decode",
               world=WORLD, dcp=DCP):
    """Run the supervisor as the command line does; with ``external_kill`` (a rank), SIGKILL
    that rank of the first world through ``--pids`` before it reports a step. Returns
    OUT.json, the pids killed, and the pids of the last world."""
    out, pids, work = tmp_path / "out.json", tmp_path / "pids.json", tmp_path / "work"
    cmd = [sys.executable, "-m", "dcp_compile.workers.supervise", "--nproc", str(world),
           "--dcp", str(dcp), "--steps", str(steps), "--lengths", ",".join(map(str, LENGTHS)),
           "--mode", mode,
           "--out", str(out), "--pids", str(pids), "--work-dir", str(work),
           "--step-timeout", str(STEP_TIMEOUT), "--max-restarts", str(len(faults) + 1)]
    for f in faults:
        cmd += ["--fault", f]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    killed = None
    try:
        if external_kill is not None:
            deadline = time.monotonic() + timeout
            while not pids.exists():
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "the supervisor wrote no --pids file"
                time.sleep(0.05)
            killed = json.loads(pids.read_text())
            assert (work / "world0" / "progress.jsonl").read_text() == ""   # still starting
            os.kill(killed[str(external_kill)], signal.SIGKILL)
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    return json.loads(out.read_text()), killed, json.loads(pids.read_text())


def _check(got, steps, reasons):
    """The tokens of the uninterrupted run, one restart per lost world, each loss named."""
    assert got["tokens"] == single_device_reference(LENGTHS, steps).tokens, got["faults"]
    assert got["restarts"] == len(reasons)
    assert all(want in f["reason"] for f, want in zip(got["faults"], reasons, strict=True)), \
        got["faults"]
    for r in got["requests"]:
        assert [s["reason"] for s in r["stops"]] == [f["reason"] for f in got["faults"]]
        assert len(r["tokens"]) == steps


@pytest.mark.multiprocess
def test_supervised_world_resumes_after_kills(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    steps = 8
    kill_step = rng.randrange(0, steps - 1)            # any step but the last
    ranks = [rng.randrange(WORLD) for _ in range(2)]
    faults = ["none", f"{ranks[1]}:{kill_step}:kill"]
    got, killed, last = _supervise(tmp_path, steps, faults, external_kill=ranks[0])
    why = f"seed {seed}: faults {faults}, killed from outside: rank {ranks[0]}"
    _check(got, steps, [f"rank {ranks[0]} was killed by SIGKILL",
                        f"rank {ranks[1]} was killed by SIGKILL"])
    # Progress is recorded as steps finish: each world resumed where the last one stopped.
    assert [f["step"] for f in got["faults"]] == [0, kill_step + 1], why
    assert [f["recomputed"] for f in got["faults"]] == [0, 4 * (kill_step + 1)], why
    assert all(f["detect_s"] is not None and f["resume_s"] is not None
               for f in got["faults"][1:]), got["faults"]
    # --pids is rewritten at every launch: the last world's ranks are new processes.
    assert set(last) == {str(r) for r in range(WORLD)}
    assert not set(last.values()) & set(killed.values())


@pytest.mark.multiprocess
@pytest.mark.skipif(not full("DCP_RESUME_FULL"), reason="the full run: DCP_RESUME_FULL=1")
def test_twenty_rank_losses_in_a_row(tmp_path):
    """20 worlds lost in one generation, each at a later random step: a random rank, SIGKILL
    (every fifth a SIGSTOP hang). Prints the measured detection and resume times."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    steps, losses = 24, 20
    at = sorted(rng.sample(range(steps - 1), losses))
    faults = [f"{rng.randrange(WORLD)}:{s}:{'stop' if i % 5 == 4 else 'kill'}"
              for i, s in enumerate(at)]
    got, _, _ = _supervise(tmp_path, steps, faults, timeout=3600)
    _check(got, steps, [f"rank {f.split(':')[0]} " + (
        "stopped (process state T)" if f.endswith("stop") else "was killed by SIGKILL")
        for f in faults])
    assert [f["step"] for f in got["faults"]] == [s + 1 for s in at], f"seed {seed}"
    for kind in ("kill", "stop"):
        rows = [f for f, spec in zip(got["faults"], faults) if spec.endswith(kind)]
        print(f"{kind}: {len(rows)} losses, detect_s "
              f"{[round(f['detect_s'], 3) for f in rows]}, resume_s "
              f"{[round(f['resume_s'], 2) for f in rows]}")
    print(f"recomputed {sum(f['recomputed'] for f in got['faults'])} generated tokens, "
          f"elapsed {got['elapsed_s']:.0f} s, seed {seed}")


@pytest.mark.multiprocess
def test_prefill_mode_world_resumes_after_a_kill(tmp_path):
    """A prefill-mode world (the prompt, then one-token sequence-parallel prefill steps) loses
    a random rank at a random step; the relaunched world computes prompt + generated again in
    chunks after a prior (a 33-token prompt + its tokens is two chunks) and ends with the
    uninterrupted single-device tokens."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    steps, world = 8, 2
    kill_step, rank = rng.randrange(0, steps - 1), rng.randrange(world)
    got, _, last = _supervise(tmp_path, steps, [f"{rank}:{kill_step}:kill"], mode="prefill",
                              world=world, dcp=2)
    why = f"seed {seed}: rank {rank} killed at step {kill_step}"
    assert got["mode"] == "prefill"
    _check(got, steps, [f"rank {rank} was killed by SIGKILL"])
    assert [f["step"] for f in got["faults"]] == [kill_step + 1], why
    assert [f["recomputed"] for f in got["faults"]] == [4 * (kill_step + 1)], why
    assert got["faults"][0]["detect_s"] is not None and got["faults"][0]["resume_s"] is not None
    assert set(last) == {"0", "1"}


@pytest.mark.multiprocess
@pytest.mark.skipif(not full("DCP_RESUME_FULL"), reason="the full run: DCP_RESUME_FULL=1")
def test_prefill_mode_eight_rank_losses_in_a_row(tmp_path):
    """8 prefill-mode worlds (tp=4/dcp=2) lost in one generation, each at a later random step:
    a random rank, SIGKILL (every fourth a SIGSTOP hang). Prints the measured times."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    steps, losses = 12, 8
    at = sorted(rng.sample(range(steps - 1), losses))
    faults = [f"{rng.randrange(WORLD)}:{s}:{'stop' if i % 4 == 3 else 'kill'}"
              for i, s in enumerate(at)]
    got, _, _ = _supervise(tmp_path, steps, faults, timeout=3600, mode="prefill")
    _check(got, steps, [f"rank {f.split(':')[0]} " + (
        "stopped (process state T)" if f.endswith("stop") else "was killed by SIGKILL")
        for f in faults])
    assert [f["step"] for f in got["faults"]] == [s + 1 for s in at], f"seed {seed}"
    for kind in ("kill", "stop"):
        rows = [f for f, spec in zip(got["faults"], faults) if spec.endswith(kind)]
        print(f"prefill {kind}: {len(rows)} losses, detect_s "
              f"{[round(f['detect_s'], 3) for f in rows]}, resume_s "
              f"{[round(f['resume_s'], 2) for f in rows]}")
    print(f"recomputed {sum(f['recomputed'] for f in got['faults'])} generated tokens, "
          f"elapsed {got['elapsed_s']:.0f} s, seed {seed}")


# --- the pieces, without processes -----------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("1:3", "must read RANK:STEP:KIND"), ("a:3:kill", "must read RANK:STEP:KIND"),
    ("1:3:crash", "kind must be one of \\['kill', 'stop'\\]")])
def test_a_bad_fault_is_refused_by_name(text, message):
    with pytest.raises(DCPInputError, match=message):
        Fault.parse(text)
    assert Fault.parse_or_none("none") is None
    assert str(Fault.parse("2:5:stop")) == "2:5:stop"


def _state(generated, steps=8):
    return {"steps": steps, "requests": [
        {"id": str(i), "prompt": [7] * n, "generated": list(g)}
        for i, (n, g) in enumerate(zip(LENGTHS, generated))]}


def test_resume_contexts_are_prompt_plus_generated():
    todo, contexts, left = resume_contexts(_state([[1, 2, 3]] * 4), 41)
    assert [r["id"] for r in todo] == ["0", "1", "2", "3"] and left == 5
    assert [len(c) for c in contexts] == [n + 3 for n in LENGTHS]
    assert contexts[0] == [7, 1, 2, 3]
    assert resume_contexts(_state([list(range(8))] * 4), 41)[0] == []


def test_resume_that_does_not_fit_the_context_step_is_refused():
    with pytest.raises(DCPInputError, match=r"in a decode world: prompt \+ generated tokens "
                                            r"\{'2': 36\} exceed the program's "
                                            r"context_len=35"):
        resume_contexts(_state([[1, 2, 3]] * 4), 35)
    with pytest.raises(DCPInputError, match=r"in a prefill world: .*\{'2': 36\} exceed the "
                                            r"program's capacity \(max_blocks x block_size x "
                                            r"dcp\)=35"):
        resume_contexts(_state([[1, 2, 3]] * 4), 35, mode="prefill")
    with pytest.raises(DCPInputError, match="unfinished requests at different steps"):
        resume_contexts(_state([[1], [1, 2], [1], [1]]), 41)


class _ChunkEngine:
    """Records the rows of each prompt step; a row's logits hold (chunk, its last token)."""

    def __init__(self):
        self.steps = []

    def prefill(self, rows):
        self.steps.append(rows)
        return torch.tensor([[len(self.steps), r[-1] if r else -1] for r in rows])


def test_a_prefill_world_resumes_in_chunks_after_a_prior():
    """Prompt + generated longer than context_len runs as chunks (a shorter context sits the
    later chunks out); each sequence's logits come from the chunk that held its last token."""
    engine = _ChunkEngine()
    contexts = [[1], list(range(10, 17)), list(range(20, 25))]
    logits = RESUMES["prefill"].context(engine, contexts, 3)
    assert engine.steps == [[[1], [10, 11, 12], [20, 21, 22]], [[], [13, 14, 15], [23, 24]],
                            [[], [16], []]]
    assert logits.tolist() == [[1, 1], [3, 16], [2, 24]]
    engine = _ChunkEngine()
    RESUMES["decode"].context(engine, contexts, 3)        # one context step, whatever it holds
    assert engine.steps == [contexts]
    RESUMES["prefill"].step(engine, [5, 6, 7])            # a generated token: a 1-token chunk
    assert engine.steps[-1] == [[5], [6], [7]]


def _world(tmp_path, text):
    progress = tmp_path / "progress.jsonl"
    progress.write_text(text)
    return supervise.World({}, progress, time.monotonic())


def test_progress_counts_whole_lines_only(tmp_path):
    requests = [supervise.Request("0", [1]), supervise.Request("1", [2, 3])]
    world = _world(tmp_path, '{"step": 0, "tokens": {"0": 5, "1": 6}}\n{"step": 1, "tok')
    assert supervise.read_progress(world, requests)
    assert [r.generated for r in requests] == [[5], [6]]
    assert not supervise.read_progress(world, requests)   # the torn line stays unread
    with open(world.progress, "a") as f:
        f.write('ens": {"0": 8, "1": 9}}\n')
    assert supervise.read_progress(world, requests)
    assert [r.generated for r in requests] == [[5, 8], [6, 9]]


def test_progress_that_skips_a_step_is_refused(tmp_path):
    requests = [supervise.Request("0", [1])]
    world = _world(tmp_path, '{"step": 1, "tokens": {"0": 5}}\n')
    with pytest.raises(DCPWorldError, match="rank 0 reported step 1 of request 0, which "
                                            "holds 0 tokens"):
        supervise.read_progress(world, requests)


def _args(steps=8):
    return supervise.parse(["--nproc", "4", "--dcp", "2", "--steps", str(steps), "--out", "x"])


def test_a_resume_the_context_step_cannot_hold_is_refused_before_any_rank_starts(tmp_path):
    requests = [supervise.Request(str(i), [7] * n, [1, 2, 3]) for i, n in enumerate(LENGTHS)]
    with pytest.raises(DCPInputError, match="cannot resume in a decode world"):
        supervise.launch(_args(), tmp_path, 1, "unused.dcp", requests, capacity=33)
    assert not (tmp_path / "world1").exists()


@pytest.mark.multiprocess
def test_a_rank_error_of_its_own_is_not_resumed(tmp_path):
    """Ranks that raise by themselves (here: a weightless program and an empty checkpoint
    directory) would raise again in every relaunch: the supervisor stops at once and shows
    the error."""
    from dcp_compile.workers import decode
    program = decode.build_program(decode.parse(["--dcp", "1", "--out", "x"]), tp=2,
                                   check=False)
    program.save(tmp_path / "decode.dcp", weights=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DCPInputError, match=r"does not fit this launch: its tp=2, the launch "
                                            r"asks tp=4"):   # before any rank starts
        supervise.supervise(supervise.parse(["--nproc", "4", "--dcp", "1", "--out", "x",
                                             "--program", str(tmp_path / "decode.dcp")]),
                            tmp_path / "refused")
    assert not list((tmp_path / "refused").glob("world*"))
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_compile.workers.supervise", "--nproc", "2", "--dcp", "1",
         "--steps", "4", "--out", str(tmp_path / "out.json"), "--program",
         str(tmp_path / "decode.dcp"), "--checkpoint", str(tmp_path / "empty"),
         "--work-dir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert "of the supervised world raised an error of" in proc.stderr, proc.stderr
    assert "DCPInputError" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "work").glob("world*")) == ["world0"]
    assert not (tmp_path / "out.json").exists()


# --- the disaggregated pair (dcp_compile.workers.supervise_pair) -----------------------------

# The decode side's handshake/transfer bound in these runs: a healthy one takes well under a
# second; a dead prefill rank costs it.
PAIR_TRANSFER_TIMEOUT = 15.0


def _supervise_pair(tmp_path, steps, faults, *, timeout=1800, decode_nproc=2):
    """Run the pair's supervisor as the command line does (prefill tp=2/dcp=2, decode
    tp=``decode_nproc``/dcp=1); OUT.json. Skips when the NIXL wheel does not import."""
    try:
        from dcp_compile.runtime.transfer.nixl.build import nixl_api
        nixl_api()
    except Exception as e:  # the wheel raises ImportError, or RuntimeError without a backend
        pytest.skip(f"import nixl failed: {type(e).__name__}: {e}")
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "dcp_compile.workers.supervise_pair", "--steps", str(steps),
           "--lengths", ",".join(map(str, LENGTHS)), "--out", str(out),
           "--work-dir", str(tmp_path / "work"), "--step-timeout", str(STEP_TIMEOUT),
           "--transfer-timeout", str(PAIR_TRANSFER_TIMEOUT),
           "--decode-nproc", str(decode_nproc),
           "--max-restarts", str(len(faults) + 1)]
    for f in faults:
        cmd += ["--fault", f]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def _check_decode_loss(f, rank):
    """A decode rank lost: every prefill rank reported its leases, each read or released
    (none still held, no block still marked held), the released ones because of the loss."""
    assert f["side"] == "decode" and f["reason"] == f"decode rank {rank} was killed by SIGKILL"
    assert f["leaked"] == {}, f
    assert set(f["leases"]) == {"0", "1"} and all(f["leases"].values()), f
    outcomes = [o for rank_leases in f["leases"].values() for o in rank_leases.values()]
    assert set(outcomes) <= {"read", "released"}, f


def _check_prefill_loss(f, rank, how="was killed by SIGKILL"):
    """A prefill rank lost: the decode side failed by itself (within the supervisor's bound:
    the transfer timeout plus a margin), its error naming that prefill rank (the handshake's
    "prefill rank p", or a READ's "prefill ranks [.., p, ..]" when it was already read from)."""
    assert f["side"] == "prefill" and f["reason"] == f"prefill rank {rank} {how}"
    assert f["decode_failed_s"] is not None, f
    named = re.compile(rf"prefill rank {rank}\b|prefill ranks \[[^\]]*\b{rank}\b")
    assert f["decode_error"] and all(named.search(e or "")
                                     for e in f["decode_error"].values()), f


@pytest.mark.multiprocess
def test_disaggregated_pair_resumes_after_a_decode_and_a_prefill_loss(tmp_path):
    """One generation, two lost pairs: a decode rank killed during the transfer (the prefill
    side releases every lease it held for it: none leaked), then a prefill rank killed while
    it serves (the decode side's request fails naming it: its refused handshake, at once,
    or its READ's timeout). The third pair resumes both to the uninterrupted single-device
    tokens. The decode world is one rank here (three fewer processes to start; the full
    runs keep tp=2): each prefill rank holds its leases for it all the same."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    steps = 6
    ranks = [0, rng.randrange(2)]
    got = _supervise_pair(tmp_path, steps, [f"decode:{ranks[0]}:-1:kill",
                                            f"prefill:{ranks[1]}:-1:kill"], decode_nproc=1)
    why = f"seed {seed}: decode rank {ranks[0]}, then prefill rank {ranks[1]}"
    assert got["tokens"] == single_device_reference(LENGTHS, steps).tokens, why
    assert got["restarts"] == 2, why
    _check_decode_loss(got["faults"][0], ranks[0])
    assert "released" in [o for r in got["faults"][0]["leases"].values() for o in r.values()]
    _check_prefill_loss(got["faults"][1], ranks[1])


@pytest.mark.multiprocess
@pytest.mark.skipif(not full("DCP_RESUME_FULL"), reason="the full run: DCP_RESUME_FULL=1")
def test_disaggregated_pair_six_losses_in_a_row(tmp_path):
    """6 pairs lost in one generation: a prefill rank during the transfer, then a decode rank
    at a random later step (or during the transfer), in turn (a decode loss last: the pair
    after it steps, which measures its resume). Prints the measured times."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    steps = 10
    at = sorted(rng.sample(range(-1, steps - 1), 3))
    faults = []
    for s in at:
        faults += [f"prefill:{rng.randrange(2)}:-1:kill", f"decode:{rng.randrange(2)}:{s}:kill"]
    got = _supervise_pair(tmp_path, steps, faults, timeout=3600)
    why = f"seed {seed}: {faults}"
    assert got["tokens"] == single_device_reference(LENGTHS, steps).tokens, why
    assert got["restarts"] == len(faults), why
    for f, spec in zip(got["faults"], faults, strict=True):
        side, rank = spec.split(":")[:2]
        (_check_decode_loss if side == "decode" else _check_prefill_loss)(f, int(rank))
    for side in ("decode", "prefill"):
        rows = [f for f in got["faults"] if f["side"] == side]
        extra = ("release_s", "decode_failed_s")[side == "prefill"]
        print(f"pair, {side} rank lost: {len(rows)} losses, detect_s "
              f"{[round(f['detect_s'], 3) for f in rows]}, {extra} "
              f"{[round(f[extra], 2) for f in rows]}, resume_s "
              f"{[f['resume_s'] and round(f['resume_s'], 1) for f in rows]}")
    print(f"recomputed {sum(f['recomputed'] for f in got['faults'])} generated tokens, "
          f"elapsed {got['elapsed_s']:.0f} s, seed {seed}")


@pytest.mark.multiprocess
@pytest.mark.skipif(not full("DCP_RESUME_FULL"), reason="the full run: DCP_RESUME_FULL=1")
def test_disaggregated_pair_resumes_after_a_decode_and_a_prefill_hang(tmp_path):
    """Two pairs lost to a hang (SIGSTOP): a decode rank at a random step (no decode step
    within --step-timeout; the reason names the stopped rank), then a prefill rank while it
    serves (the decode side's handshake or READ times out on it and fails naming it). The
    third pair resumes both to the uninterrupted tokens. Prints the measured times."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    steps = 6
    ranks, at = [rng.randrange(2), rng.randrange(2)], rng.randrange(steps - 1)
    got = _supervise_pair(tmp_path, steps, [f"decode:{ranks[0]}:{at}:stop",
                                            f"prefill:{ranks[1]}:-1:stop"], timeout=3600)
    why = f"seed {seed}: decode rank {ranks[0]} at step {at}, then prefill rank {ranks[1]}"
    assert got["tokens"] == single_device_reference(LENGTHS, steps).tokens, why
    assert got["restarts"] == 2, why
    hang = got["faults"][0]
    assert hang["side"] == "decode" and hang["step"] == at + 1, (why, hang)
    assert hang["reason"] == (f"no decode step finished for --step-timeout {STEP_TIMEOUT} s: "
                              f"decode rank {ranks[0]} stopped (process state T)"), hang
    _check_prefill_loss(got["faults"][1], ranks[1], "stopped (process state T)")
    for f in got["faults"]:
        print(f"pair, {f['side']} rank stopped: detect_s {f['detect_s']:.2f}, decode_failed_s "
              f"{f.get('decode_failed_s')}, resume_s {f['resume_s']}")
    print(f"elapsed {got['elapsed_s']:.0f} s, seed {seed}")


def test_a_stopped_rank_is_named_by_its_world(tmp_path):
    """supervise_pair names the ranks found in process state T (a hang) and their world."""
    from dcp_compile.workers.supervise_pair import _hung_side, _stopped
    procs = {r: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
             for r in range(2)}
    pair = {"prefill": supervise.World({0: procs[0]}, tmp_path / "p", 0.0),
            "decode": supervise.World({0: procs[1]}, tmp_path / "p", 0.0)}
    try:
        assert _hung_side(pair) == (None, "")
        procs[0].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while supervise.proc_state(procs[0].pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _stopped(pair["prefill"]) == [0] and _stopped(pair["decode"]) == []
        assert _hung_side(pair) == ("prefill", ": prefill rank 0 stopped (process state T)")
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


@pytest.mark.parametrize("text,message", [
    ("router:1:-1:kill", "ROLE prefill or decode"), ("decode:1:kill", "must read RANK:STEP"),
    ("prefill:1:3:kill", "prefill fault fires while the prefill world serves its KV \\(STEP "
                         "-1\\).*Use --fault prefill:1:-1:kill")])
def test_a_bad_pair_fault_is_refused_by_name(text, message):
    from dcp_compile.workers.supervise_pair import PairFault
    with pytest.raises(DCPInputError, match=message):
        PairFault.parse_or_none(text)
    assert PairFault.parse_or_none("none") is None
    fault = PairFault.parse_or_none("prefill:1:-1:kill")
    assert (fault.role, str(fault.fault)) == ("prefill", "1:-1:kill")


def test_a_lease_report_shows_leases_and_blocks_still_held():
    """lease_report (what supervise_pair's leak check reads): every ended lease's outcome,
    the leases not ended and the blocks whose epoch still marks them held (> 0)."""
    from types import SimpleNamespace
    from dcp_compile.workers.resumable_pair import lease_report
    conn = SimpleNamespace(rank=1, leases={"2": object()},
                           released={"0": SimpleNamespace(outcome="read"),
                                     "1": SimpleNamespace(outcome="released")},
                           block_epochs=torch.tensor([-3, 4, 0, -5, 4]))
    assert lease_report(conn) == {"rank": 1, "outcomes": {"0": "read", "1": "released"},
                                  "held": ["2"], "held_blocks": [1, 4]}
    conn.leases, conn.block_epochs = {}, torch.tensor([-3, -6, 0, -5, -6])
    assert lease_report(conn)["held"] == [] and lease_report(conn)["held_blocks"] == []


def test_the_pair_refuses_to_start_without_the_side_channel_key(tmp_path, monkeypatch):
    from dcp_compile.runtime.transfer.nixl.auth import DCPAuthError
    from dcp_compile.workers import supervise_pair
    for name in ("DCP_KV_KEY", "DCP_KV_KEY_FILE", "DCP_KV_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DCPAuthError, match="DCP_KV_KEY"):
        supervise_pair.supervise_pair(supervise_pair.parse(["--out", "x"]), tmp_path / "w")
    assert not (tmp_path / "w").exists()          # nothing built, nothing launched

"""Hybrid programs (recurrent layers beside DCP attention) lowered to StableHLO and run on
XLA:CPU replicas (docs/lowering.md, "Hybrid models on XLA"; docs/hybrid.md).

Each case lowers a tiny hybrid's program, runs it SPMD on tp host devices with the state
caches kept on the devices between steps, and compares every step's logits and greedy tokens
with the model's own forward (fp32, 1e-4) and, in decode, with the threaded program's (the
same engine loop, eager kernels). A mixed-length batch (prompts of 1, 5 and 8 tokens: below,
around and above the conv kernel K=4), several decode steps: the state is carried across
steps through the module's state-cache outputs. Each recurrent op's lowering rule is also
run alone against its eager op on the slot edge cases (a padding row, a fresh row, a short
row, an out-of-range slot; the garbage slot; a width-K step's snapshot slots), and
speculative width-K decode with partly rejected drafts rolls the state back on XLA.

The slice (default run): LFM2 decode at tp=4/dcp=2, the ops alone (every rule, Mamba2's
included), the named refusals. ``DCP_HYBRID_XLA_FULL=1``: LFM2 and Bamba x decode / prefill x
tp=4/dcp=2 and tp=8/dcp=4, the other families' decode at tp=4/dcp=2 (RecurrentGemma's
included), and speculative decode of Bamba, Qwen3.5 and RecurrentGemma.

XLA:CPU needs its host device count before jax initialises (test_xla.py): when jax was
initialised with fewer devices earlier in this process, a case runs in a fresh process.
"""

from __future__ import annotations

import re
from dataclasses import replace
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":        # child process of _in_xla_process: this worktree first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from tests.support.suite_path import install   # the suite's import path, as conftest sets it
    install()

pytest.importorskip("jax", reason="XLA tests need jax/jaxlib (pip install -e '.[xla]')")
pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (the stablehlo extra)")

import dcp_compile  # noqa: E402
from dcp_compile import verify as V  # noqa: E402
from dcp_compile import xla as X  # noqa: E402
from dcp_compile.runtime.errors import DCPLoweringError  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402

from full_runs import full  # noqa: E402
from xla_process import child_main, in_xla_process, run_lowered_alone  # noqa: E402

MAX_TP = 8
X.request_host_devices(MAX_TP)

TOL = 1e-4
LENGTHS = (1, 5, 8)
STEPS = 5                       # the prompt step, then four decode steps
SHAPES = StepShapes(batch=3, context_len=8, max_blocks=8, num_blocks=16)
BLOCK = 2
FULL = full("DCP_HYBRID_XLA_FULL")

LAYOUTS = ((4, 2), (8, 4))
# (model type, mode, tp, dcp) of the slice: LFM2 (short conv) decode.
SLICE = {("lfm2", "decode", 4, 2)}
# Every other family whose recurrent op has a lowering rule: decode at tp=4/dcp=2.
OTHER_FAMILIES = ("jamba", "qwen3_5_text", "minimax", "kimi_linear", "recurrent_gemma",
                  "nemotron_h")


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _program(model_type, mode, tp, dcp):
    from hybrid_configs import build_hybrid
    model = build_hybrid(model_type)
    return model, dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=BLOCK,
                                        shapes=SHAPES, check=False)


def case_program(model_type, mode, tp, dcp) -> dict:
    """Lower the program, run it on XLA, compare with the model's own forward and (decode)
    the threaded program. Returns the measured errors and the lowered modules' facts."""
    from dcp_compile.frontends.ordinary import FullForwardReference
    model, program = _program(model_type, mode, tp, dcp)
    lowered = X.lower_for_xla(program)
    spec = program.state_spec()
    modules = {step: {"aliased": m.text.count("tf.aliasing_output"),
                      "state_outputs": sum(n.startswith("new_state_caches")
                                           for n in m.output_names),
                      # a scatter into an input: a cache write left whole (MoE's
                      # routing scatter into a constant is not one)
                      "cache_scatters": len(re.findall(r'"stablehlo\.scatter"\(%arg',
                                                       m.text))}
               for step, m in lowered.modules.items()}
    out = {"modules": modules, "state_caches": len(spec.input_order()),
           "kv_caches": 2 * program.cache_spec().num_layers}
    reference = FullForwardReference(model)
    if mode == "prefill":
        plan = V.chunk_plan_of(_prompts(), 2)
        out["model"] = X.verify_prefill(reference, program, plan, atol=TOL, lowered=lowered,
                                        check_cache=False).to_json()
        return out
    ref, _ = V.run_reference(reference, program, _prompts(), STEPS)
    executor = X.XLAExecutor(program, lowered, effort=X.VERIFY_EFFORT)
    got = X.generate(program, _prompts(), STEPS, executor=executor)
    states = executor.states                    # [rank][state cache], on the host
    # replicated layout: every rank the same bytes; cut by heads over tp: each rank its own
    # heads (the spec's 1/tp shapes), so no two ranks hold the same state
    out["state_tp"] = spec.tp
    out["states_replicated"] = all(torch.equal(a, b) for rank in states[1:]
                                   for a, b in zip(states[0], rank))
    want = [tuple(t.shape) for t in spec.allocate_inputs()]
    out["states_cut"] = spec.tp > 1 and not out["states_replicated"] and all(
        [tuple(t.shape) for t in rank] == want for rank in states)
    out["states_written"] = all(bool(s[:len(LENGTHS)].abs().sum() > 0) for s in states[0])
    try:                                        # a hybrid step without its rows' slots
        executor.step("decode", *(torch.zeros(3, 1, dtype=torch.int64),) * 2,
                      torch.zeros(3, SHAPES.max_blocks, dtype=torch.int64))
        out["refused"] = None
    except X.DCPXLAError as e:
        out["refused"] = str(e)
    runs = V.run_threaded_program(program, _prompts(), STEPS)
    threaded = runs[0].result
    # every rank's state caches as the threaded program leaves them (its heads' when cut)
    out["states_error"] = max(float((x - t).abs().max()) for rank, run in enumerate(runs)
                              for x, t in zip(states[rank], run.states))
    out["model"] = {"tokens_agree": got.tokens == ref.tokens,
                    "max_abs_error": max(float((g - e).abs().max())
                                         for g, e in zip(got.logits, ref.logits))}
    out["threaded"] = {"tokens_agree": got.tokens == threaded.tokens,
                       "max_abs_error": max(float((g - e).abs().max())
                                            for g, e in zip(got.logits, threaded.logits))}
    out["steps"] = len(got.logits)
    return out


# -- each recurrent op's rule alone, on the slot edge cases ------------------------------

SLOTS = 4                       # + the garbage slot


def _rows():
    """Four rows: a continuing sequence (slot 1, 3 tokens), a fresh one (slot 0, 2 tokens),
    a padding row (-1, no tokens) and an out-of-range slot (7: the garbage slot)."""
    slot = torch.tensor([1, 0, -1, 7])
    fresh = torch.tensor([False, True, False, False])
    lengths = torch.tensor([3, 2, 0, 1])
    return slot, fresh, lengths


def _op_cases():
    """op name -> (function of tensors calling the op, its inputs)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    Bsz, S, K = 4, 3, 4
    slot, fresh, lengths = _rows()
    ops = torch.ops.dcp
    cases = {}
    C = 12
    cases["short_conv"] = (
        lambda x, w, b, cs, sl, fr, ln: ops.short_conv(x, w, b, cs, sl, fr, ln),
        [r(Bsz, S, C), r(C, K), r(C), r(SLOTS + 1, C, K - 1), slot, fresh, lengths])
    H, P, N, G = 4, 2, 3, 2
    Cm = H * P + 2 * G * N
    cases["mamba2_ssm"] = (
        lambda x, dt, w, b, al, d, db, cs, ss, sl, fr, ln: ops.mamba2_ssm(
            x, dt, w, b, al, d, db, cs, ss, sl, fr, ln, G, P, N, "silu", 0.0, float("inf")),
        [r(Bsz, S, Cm), r(Bsz, S, H), r(Cm, K), r(Cm), r(H), r(H), r(H),
         r(SLOTS + 1, Cm, K - 1), r(SLOTS + 1, H, P, N), slot, fresh, lengths])
    D, Nm = 6, 3
    cases["mamba_ssm"] = (
        lambda x, dt, al, b, c, d, db, ss, sl, fr, ln: ops.mamba_ssm(
            x, dt, al, b, c, d, db, ss, sl, fr, ln),
        [r(Bsz, S, D), r(Bsz, S, D), r(D, Nm), r(Bsz, S, Nm), r(Bsz, S, Nm), r(D), r(D),
         r(SLOTS + 1, D, Nm), slot, fresh, lengths])
    Hk, Hv, dk, dv = 2, 4, 4, 4
    Cg = 2 * Hk * dk + Hv * dv
    cases["gated_delta_net"] = (
        lambda q, gg, be, w, cs, rs, sl, fr, ln: ops.gated_delta_net(
            q, gg, be, w, cs, rs, sl, fr, ln, Hk, dk, dv),
        [r(Bsz, S, Cg), -r(Bsz, S, Hv).abs(), r(Bsz, S, Hv).sigmoid(), r(Cg, K),
         r(SLOTS + 1, Cg, K - 1), r(SLOTS + 1, Hv, dk, dv), slot, fresh, lengths])
    Hd, d = 2, 4
    Ck = 3 * Hd * d
    cases["kimi_delta_attention"] = (
        lambda q, gg, be, w, cs, rs, sl, fr, ln: ops.kimi_delta_attention(
            q, gg, be, w, cs, rs, sl, fr, ln, Hd, d),
        [r(Bsz, S, Ck), -r(Bsz, S, Hd, d).abs(), r(Bsz, S, Hd).sigmoid(), r(Ck, K),
         r(SLOTS + 1, Ck, K - 1), r(SLOTS + 1, Hd, d, d), slot, fresh, lengths])
    W, Hr = 8, 2                                            # RG-LRU: 2 heads of 4
    cases["rg_lru"] = (
        lambda x, iw, ib, rw, rb, rp, rs, sl, fr, ln: ops.rg_lru(
            x, iw, ib, rw, rb, rp, rs, sl, fr, ln),
        [r(Bsz, S, W), r(Hr, W // Hr, W // Hr), r(Hr, W // Hr), r(Hr, W // Hr, W // Hr),
         r(Hr, W // Hr), r(W), r(SLOTS + 1, W), slot, fresh, lengths])
    # a width-K step's snapshots: row 0 keeps its state after its first token in slot 2
    snap = torch.full((Bsz, S), -1, dtype=torch.int64)
    snap[0, 0] = 2
    conv_fn, conv_in = cases["short_conv"]
    cases["short_conv/snapshots"] = (
        lambda x, w, b, cs, sl, fr, ln, sn: ops.short_conv(x, w, b, cs, sl, fr, ln, sn),
        conv_in + [snap])
    m2_fn, m2_in = cases["mamba2_ssm"]
    cases["mamba2_ssm/snapshots"] = (
        lambda x, dt, w, b, al, d, db, cs, ss, sl, fr, ln, sn: ops.mamba2_ssm(
            x, dt, w, b, al, d, db, cs, ss, sl, fr, ln, G, P, N, "silu", 0.0, float("inf"),
            sn),
        m2_in + [snap])
    cases["lightning_attention"] = (
        lambda q, k, v, s, rs, sl, fr, ln: ops.lightning_attention(q, k, v, s, rs, sl, fr, ln),
        [r(Bsz, S, Hd, d), r(Bsz, S, Hd, d), r(Bsz, S, Hd, d), r(Hd).abs(),
         r(SLOTS + 1, Hd, d, d), slot, fresh, lengths])
    return cases


def case_ops() -> dict:
    """Each op lowered alone (lower_function: its rule) and run on one XLA:CPU device
    against the eager op: op -> (max |error| over every output, garbage slot written,
    slot 2 and 3 (no row's) unchanged)."""
    out = {}
    for name, (fn, inputs) in _op_cases().items():
        want = fn(*inputs)
        _, got = run_lowered_alone(fn, inputs, name)
        snapshots = name.endswith("/snapshots")
        cache_in, cache_out = inputs[-5 if snapshots else -4], got[-1]
        free = slice(3, SLOTS) if snapshots else slice(2, SLOTS)   # slots no row writes
        out[name] = {"error": max(float((g - w).abs().max()) for g, w in zip(got, want)),
                     "untouched": bool(torch.equal(cache_out[free], cache_in[free])),
                     "garbage_written": not torch.equal(cache_out[SLOTS], cache_in[SLOTS]),
                     "snapshot_written": not snapshots or
                     not torch.equal(cache_out[2], cache_in[2])}
    return out


# -- speculative (width-K) decode: the state snapshots and the roll-back --------------------

K = 3                                   # a row verifies up to 2 drafts


def case_speculative(model_type, tp, dcp) -> dict:
    """Width-3 verification steps with partly wrong drafts (test_hybrid_hspec's drafter) on
    XLA against the model's own greedy decode; prefix caching refused by name."""
    from dataclasses import replace

    from dcp_compile.frontends.ordinary import FullForwardReference
    from hybrid_configs import build_hybrid
    from test_hybrid_hspec import WrongOnPurpose
    model = build_hybrid(model_type)
    program = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="decode", block_size=BLOCK,
                                    shapes=replace(SHAPES, decode_len=K), check=False)
    reference = FullForwardReference(model)
    steps = 7
    ref, _ = V.run_reference(reference, program, _prompts(), steps)
    drafter = WrongOnPurpose(_prompts(), ref.tokens, model.config.vocab_size)
    report = X.verify_speculative(reference, program, _prompts(), steps, drafter, atol=TOL)
    executor = object.__new__(X.XLAExecutor)      # copy_state needs no compiled module
    try:
        executor.copy_state(0, 1)
        refused = None
    except X.DCPXLAError as e:
        refused = str(e)
    return {"report": report.to_json(), "refused": refused}


@pytest.mark.parametrize("model_type,tp,dcp", [
    pytest.param(t, tp, dcp, id=f"{t}-tp{tp}-dcp{dcp}",
                 marks=() if FULL else pytest.mark.skip(reason="DCP_HYBRID_XLA_FULL=1 runs it"))
    for t in ("bamba", "qwen3_5_text", "recurrent_gemma") for tp, dcp in ((4, 2),)])
def test_speculative_hybrid_on_xla_rolls_the_state_back(model_type, tp, dcp, tmp_path):
    got = _in_xla_process("case_speculative", model_type, tp, dcp, tmp_path=tmp_path)
    report = got["report"]
    assert report["ok"] and report["tokens_agree"], report
    spec = report["spec"]
    assert 0 < spec["accepted"] < spec["drafted"], spec
    # a step with a rejected draft after an accepted one: the state rolled back mid-row
    assert any(a == 1 for step in spec["accepted_per_step"] for a in step), spec
    assert "prefix caching of a hybrid program on XLA is not built" in got["refused"], got
    print(f"{model_type} tp={tp} dcp={dcp} speculative K={K} on XLA: max |logit error| "
          f"{report['max_abs_error']:.1e}, {spec['accepted']}/{spec['drafted']} drafts "
          f"accepted")


def _in_xla_process(case: str, *args, tmp_path):
    return in_xla_process(globals(), case, *args, tmp_path=tmp_path, max_tp=MAX_TP)


def _cases():
    cells = [(t, mode, tp, dcp) for t in ("lfm2", "bamba") for mode in ("decode", "prefill")
             for tp, dcp in LAYOUTS] + [(t, "decode", 4, 2) for t in OTHER_FAMILIES]
    return [pytest.param(*cell, id=f"{cell[0]}-{cell[1]}-tp{cell[2]}-dcp{cell[3]}",
                         marks=() if cell in SLICE or FULL else
                         pytest.mark.skip(reason="DCP_HYBRID_XLA_FULL=1 runs it"))
            for cell in cells]


@pytest.mark.parametrize("model_type,mode,tp,dcp", _cases())
def test_hybrid_program_on_xla_matches_the_model_and_the_threaded_program(
        model_type, mode, tp, dcp, tmp_path):
    got = _in_xla_process("case_program", model_type, mode, tp, dcp, tmp_path=tmp_path)
    model = got["model"]
    assert model["tokens_agree"] and model["max_abs_error"] <= TOL, got
    if mode == "decode":
        assert got["threaded"]["tokens_agree"], got
        assert got["threaded"]["max_abs_error"] <= TOL, got
        assert got["steps"] == STEPS              # a logits row per step: the state carried
        # the state is whole on every rank and the same bytes on each (replicated over DCP),
        # or, cut by heads (MiniMax, Kimi Linear at tp=4), each rank's own heads
        assert got["states_written"], got
        assert got["states_replicated"] if got["state_tp"] == 1 else got["states_cut"], got
        assert got["states_error"] <= 1e-5, got
        assert "pass each row's state_slot=" in got["refused"], got
    else:
        assert model["ok"], got
    # every KV and state cache is an input donated to the output that replaces it; a decode
    # program's cache and state writes are row updates (dynamic_update_slice), no scatter
    caches = got["kv_caches"] + got["state_caches"]
    for step, facts in got["modules"].items():
        assert facts["aliased"] == caches, (step, got)
        assert facts["state_outputs"] == got["state_caches"], (step, got)
        assert mode != "decode" or facts["cache_scatters"] == 0, (step, got)
    print(f"{model_type} {mode} tp={tp} dcp={dcp} on XLA: max |logit error| vs the model "
          f"{model['max_abs_error']:.1e}"
          + (f", vs the threaded program {got['threaded']['max_abs_error']:.1e}"
             if mode == "decode" else ""))


def test_each_recurrent_op_lowers_to_its_eager_result_on_the_slot_edge_cases(tmp_path):
    """Every row of RECURRENT_LOWERING, lowered alone (and two with a width-K step's state
    snapshots): outputs and state caches equal the eager op's; slots no row names are
    unchanged; padding and out-of-range rows write the garbage slot."""
    from dcp_compile.lowering.recurrent import RECURRENT_LOWERING
    got = _in_xla_process("case_ops", tmp_path=tmp_path)
    assert {name.split("/")[0] for name in got} == \
        {op._schema.name.split("::")[1] for op in RECURRENT_LOWERING}
    for name, facts in got.items():
        assert facts["error"] <= 1e-5 and facts["untouched"] and facts["garbage_written"] \
            and facts["snapshot_written"], (name, facts)
    print("lowered alone vs eager, max |error|: "
          + ", ".join(f"{name} {facts['error']:.1e}" for name, facts in got.items()))


# -- refusals, by name ---------------------------------------------------------------------

def _short_conv_graph():
    """A hand-built graph calling dcp.short_conv."""
    from torch.fx.experimental.proxy_tensor import make_fx
    fn, inputs = _op_cases()["short_conv"]
    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_a_recurrent_op_without_a_rule_is_refused_naming_it(monkeypatch):
    from dcp_compile.lowering import check_lowerable
    from dcp_compile.lowering import recurrent
    gm = _short_conv_graph()
    check_lowerable(gm, "decode")                         # lowers with its rule
    monkeypatch.delitem(recurrent.RECURRENT_LOWERING, torch.ops.dcp.short_conv.default)
    with pytest.raises(DCPLoweringError, match=r"cannot lower recurrent op dcp::short_conv at "
                                               r"node short_conv.*step 'decode'.*not built"):
        check_lowerable(gm, "decode")


if __name__ == "__main__":        # child process of _in_xla_process
    child_main(globals())

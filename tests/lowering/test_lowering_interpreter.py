"""The lowered programs in the StableHLO reference interpreter (it ships in torch-mlir's
bindings): the tp=1 program against the eager model, the DCP primitives standalone against
their eager reference on the edge cases, and the whole DCP program on interpreter replicas
with real StableHLO collectives against the single-device model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_mlir", reason="lowering needs torch-mlir (pip install torch-mlir)")

import dcp_compile  # noqa: E402
from dcp_compile.runtime import layout  # noqa: E402
from dcp_compile.lowering import (COLLECTIVE_OPS, collectives_in,  # noqa: E402
                                  interpreter_available, lower, lower_function,
                                  run_interpreter)
from dcp_compile.models.demo import DemoConfig, demo_model  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from dcp_compile.runtime.errors import DCPLoweringError  # noqa: E402

from helpers import assert_close_report  # noqa: E402
from lowering_helpers import LAYERS, program_for  # noqa: E402

needs_interpreter = pytest.mark.skipif(not interpreter_available()[0],
                                       reason=interpreter_available()[1])


# The reference interpreter is slow on scatters into large operands (cache writes): keep the
# tp=1 program's cache small. Block 3 is the garbage block.
TP1_SHAPES = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=4)


def _step_inputs(kind, g):
    if kind == "decode":
        # Row 0 decodes position 20 (blocks 1, 2 hold its 20 prior tokens); row 1 is padding.
        return (torch.tensor([[5], [0]]), torch.tensor([[20], [-1]]),
                torch.tensor([[1, 2], [-1, -1]]))
    S = TP1_SHAPES.context_len
    ids = torch.randint(0, 256, (TP1_SHAPES.batch, S), generator=g)
    pos = torch.full((TP1_SHAPES.batch, S), -1)
    pos[0] = torch.arange(S)
    pos[1, :3] = torch.arange(3)
    return ids, pos, torch.tensor([[0, -1], [1, -1]])


@needs_interpreter
@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float32, 1e-4, id="fp32"),
                                        pytest.param(torch.bfloat16, None, id="bf16")])
def test_tp1_program_in_the_interpreter_matches_the_eager_model(dtype, atol, monkeypatch):
    """The tp=1 program (no collective left) against the eager model, every step kind; its
    layer 1 is lowered from layer 0's decompositions (decompose_by_op's copies), so this
    also shows the copies compute the model (tests/lowering/test_lowering_reuse.py: the structure)."""
    from dcp_compile import lowering
    caches = []

    class Recorded(lowering.DecompositionCache):
        def __init__(self):
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(lowering, "DecompositionCache", Recorded)
    model, prog = program_for(1, 1, "decode", dtype, TP1_SHAPES,
                              check=False)      # compared with the model below, every step
    result = lower(prog)
    assert prog.num_layers == LAYERS > 1 and caches[0].copied > 0, caches
    for m in result.modules.values():
        assert not collectives_in(m.text) and len(m.elided) == 2 * LAYERS + 2
    spec = prog.cache_spec(dtype)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(spec.shape, generator=g).to(dtype) for _ in range(2 * LAYERS)]
    state = prog.state_dict_for(0)
    prefix = [state[n] for n in prog.weight_inputs] + [state["tp_rank"]]
    for kind in prog.graphs:
        ids, pos, table = _step_inputs(kind, g)
        got = run_interpreter(result[kind], prefix + [ids, pos, table] + caches)
        with torch.no_grad():
            ref_logits, ref_caches = model(ids, pos, table, [c.clone() for c in caches])
        if atol is None:
            # The reference interpreter computes bf16 dot products and sums in bf16 (eager
            # accumulates in f32): allow a few bf16 ulps of the logits' scale.
            atol = 0.1 * float(ref_logits.float().abs().max())
        assert_close_report(got[0], ref_logits, atol=atol, what=f"{kind} logits")
        garbage = spec.garbage_block
        for i, (a, b) in enumerate(zip(got[1:], ref_caches)):
            assert_close_report(a[:garbage], b[:garbage], atol=atol, what=f"{kind} cache {i}")


# Standalone DCP primitives: W = 4 ranks, interleave 4, block 8 (vblock 32).
W, I, B = 4, 4, 8
POSITIONS = torch.tensor([[5], [0], [33], [-1]])     # decode token of each sequence
TABLE = torch.tensor([[1, 2], [3, -1], [4, 5], [-1, -1]])
SCALE = 0.35


def dcp_decode_piece(q, k, v, key_cache, value_cache, positions, block_table, rank):
    """One rank's share of a decode attention, as the dcp_decode pass emits it: masked cache
    write, local_filled prior, dcp_active_mask on the current key, partial attention + LSE."""
    slots = torch.ops.dcp.slot_mapping(positions, block_table, rank, W, I, B)
    kc, vc = torch.ops.dcp.cache_write(key_cache, value_cache, k, v, slots)
    prior = torch.ops.dcp.local_filled(positions[:, 0], rank, W, I, B)
    active = torch.ops.dcp.active_mask(positions, rank, W, I, B)
    k_pos = torch.where(active == 1, positions, torch.full_like(positions, -1))
    out, lse = torch.ops.dcp.partial_attention(q, positions, k, v, k_pos, kc, vc, block_table,
                                               prior, rank, W, I, SCALE)
    return out, lse, kc, vc


def lse_combine_piece(out, lse, lse_all):
    return torch.ops.dcp.lse_correct(out, lse, lse_all)


def _piece_inputs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 1, 4, 8, generator=g)
    k, v = torch.randn(4, 1, 2, 8, generator=g), torch.randn(4, 1, 2, 8, generator=g)
    # Every cache row holds data (also rows beyond local_filled): masks must hide them.
    # Blocks 0..5 are usable, block 6 is the garbage block (no block table names it).
    kc, vc = torch.randn(7, B, 2, 8, generator=g), torch.randn(7, B, 2, 8, generator=g)
    return q, k, v, kc, vc


@pytest.fixture(scope="module")
def lowered_pieces():
    q, k, v, kc, vc = _piece_inputs()
    rank = torch.tensor(0)
    attn = lower_function(dcp_decode_piece, [q, k, v, kc, vc, POSITIONS, TABLE, rank],
                          name="dcp_decode_piece")
    lse_all = torch.zeros(W, 4, 1, 4)
    combine = lower_function(lse_combine_piece, [q, torch.zeros(4, 1, 4), lse_all],
                             name="lse_combine_piece")
    return attn, combine


def _equal_with_inf(a, b, what):
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{what}: -inf pattern differs"
    fin = torch.isfinite(b)
    assert_close_report(a[fin], b[fin], atol=1e-5, what=what)


@needs_interpreter
@pytest.mark.parametrize("rank", range(W), ids=[f"rank={r}" for r in range(W)])
def test_dcp_decode_piece_in_the_interpreter_matches_eager_on_edge_cases(rank,
                                                                         lowered_pieces):
    attn, _ = lowered_pieces
    assert not any(op in attn.text for op in COLLECTIVE_OPS + ("custom_call",))
    q, k, v, kc, vc = _piece_inputs()
    r = torch.tensor(rank)
    got = run_interpreter(attn, [q, k, v, kc, vc, POSITIONS, TABLE, r])
    ref = dcp_decode_piece(q, k, v, kc.clone(), vc.clone(), POSITIONS, TABLE, r)
    _equal_with_inf(got[1], ref[1], "lse")
    assert_close_report(got[0], ref[0], atol=1e-5, what="partial out")
    for a, b in ((got[2], ref[2]), (got[3], ref[3])):
        assert torch.equal(a[:-1], b[:-1])          # garbage block: whichever write lands
    kw = dict(dcp=W, interleave=I, block=B)
    for row, p in enumerate(POSITIONS[:, 0].tolist()):
        owned = p >= 0 and layout.owner(p, **kw) == rank
        empty = p < 0 or layout.local_filled(p, rank, **kw) == 0
        if empty and not owned:       # edge case "empty shard": contributes exactly nothing
            assert torch.isneginf(got[1][row]).all() and not got[0][row].any(), (rank, p)
        else:
            assert torch.isfinite(got[1][row]).all(), (rank, p)
        # Edge case "active token not owned": the non-owner writes only the garbage block.
        changed = (got[2][:-1] != kc[:-1]).flatten(1).any(1).nonzero().flatten().tolist()
        slot_blocks = {TABLE[b, (layout.local_slot(pp, **kw)) // B].item()
                       for b, pp in enumerate(POSITIONS[:, 0].tolist())
                       if pp >= 0 and layout.owner(pp, **kw) == rank}
        assert set(changed) == slot_blocks, (rank, changed, slot_blocks)


@needs_interpreter
def test_lse_combination_in_the_interpreter_matches_eager_and_never_nans(lowered_pieces):
    attn, combine = lowered_pieces
    q, k, v, kc, vc = _piece_inputs()
    parts = [run_interpreter(attn, [q, k, v, kc, vc, POSITIONS, TABLE, torch.tensor(r)])
             for r in range(W)]
    lse_all = torch.stack([p[1] for p in parts])             # what the LSE all-gather gives
    assert torch.isneginf(lse_all).any()                      # some shard is empty
    assert torch.isneginf(lse_all[:, 3]).all()                # padding: no rank sees a key
    total = 0
    for r, (out, lse, _, _) in enumerate(parts):
        got = run_interpreter(combine, [out, lse, lse_all])[0]
        ref = lse_combine_piece(out, lse, lse_all)
        assert_close_report(got, ref, atol=1e-5, what=f"corrected out rank {r}")
        total = total + got
    assert torch.isfinite(total).all() and not total[3].any()
    # The combination is exact attention over the union of the shards' keys: a row whose
    # keys all sit on one rank equals that rank's partial output.
    kw = dict(dcp=W, interleave=I, block=B)
    row = 1                                                   # position 0: only its owner
    owner = layout.owner(0, **kw)
    assert_close_report(total[row], parts[owner][0][row], atol=1e-5, what="single-owner row")


@needs_interpreter
def test_integer_floor_division_and_remainder_are_exact_for_negative_operands():
    # torch-mlir alone lowers integer remainder to a truncating stablehlo.remainder
    # (-7 % 4 -> -3, torch says 1) and floor division through f64.
    def f(a, b):
        return a // b, a % b, a // 4, a % 4, torch.remainder(a, -3)

    a = torch.tensor([[-7, 7, 0, 33, -32, -1]])
    b = torch.tensor([[2, -2, 3, 4, 8, 5]])
    m = lower_function(f, [a, b], name="int_division")
    assert "f64" not in m.text
    for got, ref in zip(run_interpreter(m, [a, b]), f(a, b)):
        assert torch.equal(got, ref), (got, ref)


# The whole DCP program, lowered, on interpreter replicas with real StableHLO collectives.
# The interpreter runs replicas on one thread per CPU and aborts a collective after 3 s, so:
# two ranks (this machine has two CPUs), tiny shapes, a child process for the runs.
SPMD_SHAPES = StepShapes(batch=2, context_len=8, max_blocks=1, num_blocks=3)

# (mode, model kind, decode combine) -> the collectives (kind, role) the module must run:
# the spec's decode collectives (or the all-to-all combine's), prefill's CP-KV ones.
WORLDS = {
    ("decode", "demo", "all_gather"): {("all_gather", "dcp"), ("reduce_scatter", "dcp"),
                                       ("all_reduce", "tp")},
    ("decode", "demo", "all_to_all"): {("all_gather", "dcp"), ("all_to_all", "dcp"),
                                       ("all_reduce", "tp")},
    ("prefill", "demo", None): {("all_gather", "cp_kv"), ("reduce_scatter", "cp_kv")},
    ("decode", "mla", "all_gather"): {("all_gather", "dcp"), ("reduce_scatter", "dcp"),
                                      ("all_reduce", "tp")},
    ("prefill", "mla", None): {("all_gather", "cp_kv"), ("reduce_scatter", "cp_kv")},
}


def _interpreter_world(tp: int, dcp: int, mode: str, model_kind: str = "demo",
                       combine: str | None = None, results: dict | None = None) -> dict:
    """Serve prompts with the lowered modules on the interpreter's replicas, and with the
    single-device model (an ordinary model: its own full forward); return both. ``results``:
    the interpreter runs of earlier worlds (InterpreterExecutor: a step whose module text
    and inputs are byte-identical to an earlier run's takes its outputs)."""
    from dcp_compile.lowering import InterpreterExecutor
    from dcp_compile.runtime.serving.rank_engine import prompt_kind
    from dcp_compile.verify import run_reference
    from dcp_compile.runtime.serving.engine import Engine

    from helpers import prompts_of
    options = {"check": False}       # the world compares every step with the model
    if combine is not None:
        options["combine"] = combine
    if model_kind == "mla":               # one latent head, absorbed (docs/moe-mla.md: MLA)
        from dcp_compile.models.mla import plain_mla
        from dcp_compile.frontends.ordinary import FullForwardReference
        model = plain_mla(num_layers=1)
        vocab = model.config.vocab_size
        prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, shapes=SPMD_SHAPES,
                                     **options)
        model = FullForwardReference(model)
    else:
        model = demo_model(DemoConfig(num_layers=1, num_kv_heads=1))  # tp=2 > kv heads
        vocab = model.config.vocab_size
        prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, shapes=SPMD_SHAPES,
                                     **options)
    lowered = lower(prog)
    prompts, steps = prompts_of((3, 7), vocab=vocab), 3
    executor = InterpreterExecutor(prog, lowered, results=results)
    engine = Engine(executor, SPMD_SHAPES,
                    block_size=prog.config.block_size, dcp=prog.config.dcp,
                    prompt_kind=prompt_kind(prog))
    ref, _ = run_reference(model, prog, prompts, steps if mode == "decode" else 1)
    if mode == "decode":
        got = engine.generate(prompts, steps)
        result = {"tokens": got.tokens, "logits": got.logits}
    else:                      # a prefill program has no decode step: the prompt's logits
        result = {"logits": [engine.prefill(prompts)]}
    collectives = {step: [(c.kind, c.role, c.replica_groups) for c in m.collectives]
                   for step, m in lowered.modules.items()}
    return {"result": result, "ref_tokens": ref.tokens, "ref_logits": ref.logits,
            "collectives": collectives, "reused": executor.reused}


def _interpreter_worlds(out: str) -> None:
    """Child process: every world of WORLDS at tp=2/dcp=2, one after the other (one process
    start for all), sharing their interpreter runs (the two demo decode worlds differ only
    in their decode combine: their prompt steps are the same module on the same inputs);
    save the results by world."""
    results: dict = {}
    torch.save({world: _interpreter_world(2, 2, *world, results=results) for world in WORLDS},
               out)


@needs_interpreter
def test_lowered_programs_on_interpreter_replicas_match_the_single_device_model(tmp_path):
    """Each world of WORLDS (decode with either combine, prefill; the demo model and MLA),
    lowered, on two interpreter replicas: its collectives ran, on real data, and its tokens
    and logits equal the single-device model's. One test, one child process for the five
    worlds (each world was a test and a process of its own; the claims are the same)."""
    # tp=2/dcp=2: the interpreter runs one replica per CPU (two here); the MLA program at
    # tp=8/dcp=8 runs on XLA:CPU replicas instead (tests/lowering/test_mla_xla.py).
    import os
    import subprocess
    import sys
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the interpreter needs one CPU per rank (2)")
    out = tmp_path / "worlds.pt"
    from suite_path import ROOT
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from tests.support.suite_path import install; install(); "
            f"import test_lowering_interpreter as t; "
            f"t._interpreter_worlds({str(out)!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worlds = torch.load(out)
    assert set(worlds) == set(WORLDS)
    for world, expected in WORLDS.items():
        r, mode = worlds[world], world[0]
        kinds = {(kind, role) for coll in r["collectives"].values() for kind, role, _ in coll}
        assert expected <= kinds, (world, kinds)
        if mode == "decode":
            assert r["result"]["tokens"] == r["ref_tokens"], world
        # Only the all-to-all world's prompt step is the all-gather world's, byte for byte.
        assert (r["reused"] > 0) == (world == ("decode", "demo", "all_to_all")), (world, r)
        for t, (got, exp) in enumerate(zip(r["result"]["logits"], r["ref_logits"])):
            assert_close_report(got, exp, atol=1e-4, what=f"{world} step {t} logits")


def test_interpreter_run_digest_tells_apart_text_dtype_shape_and_bytes():
    """InterpreterExecutor's shared results key runs by this digest: anything that could
    change a run's outputs changes it."""
    from dcp_compile.lowering.interpreter import _run_digest
    x = torch.arange(6, dtype=torch.float32)
    base = _run_digest("m", [[x, torch.tensor(0)]])
    assert base == _run_digest("m", [[x.clone(), torch.tensor(0)]])
    variants = [_run_digest("m2", [[x, torch.tensor(0)]]),
                _run_digest("m", [[x.view(2, 3), torch.tensor(0)]]),
                _run_digest("m", [[x.view(torch.int32), torch.tensor(0)]]),
                _run_digest("m", [[x + 1, torch.tensor(0)]]),
                _run_digest("m", [[x, torch.tensor(1)]]),
                _run_digest("m", [[x], [torch.tensor(0)]])]
    assert len({base, *variants}) == 1 + len(variants)


def _module_with_collectives_over(tp: int):
    """A lowered module whose collectives span ``tp`` replicas, as a tp program's do (the
    refusals read only the module's collectives: a two-collective graph lowers in ~0.1 s,
    the tp=8 demo program in seconds)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dcp_compile.lowering import lower_graph
    F = torch.ops._c10d_functional

    def f(x):
        y = F.wait_tensor(F.all_reduce(x, "sum", "dcp_role:tp"))
        return F.wait_tensor(F.all_gather_into_tensor(y, tp // 2, "dcp_role:dcp"))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 4))
    groups = {"tp": [list(range(tp))],
              "dcp": [list(range(tp // 2)), list(range(tp // 2, tp))]}
    return lower_graph(gm, step="decode", groups=groups, tp=tp)


def test_interpreter_refuses_what_would_abort_it():
    import os
    from dcp_compile.lowering import run_interpreter_spmd
    module = _module_with_collectives_over(8)
    with pytest.raises(DCPLoweringError, match=r"collectives span replicas \[0, 1, .*7\], "
                                               r"but 1 rank"):
        run_interpreter(module, [])
    if len(os.sched_getaffinity(0)) < 8:
        with pytest.raises(DCPLoweringError, match="8 ranks would deadlock"):
            run_interpreter_spmd(module, [[]] * 8)

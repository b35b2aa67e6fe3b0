"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, HY-V4) through ``transform``: the captured
``dcp.index_topk`` node rewritten into the exact DCP selection (passes/sparse_attention.py
reads it off the mask; insert_paged_cache caches the indexer's K beside the MLA latent;
dcp_decode / dcp_prefill emit index_scores, index_candidates, one all-gather, the threshold
and ``partial_attention(keep=)``). The program must be the model's own forward (fp32, 1e-4,
greedy tokens) with ``index_topk`` smaller than the prompts, so the indexer cuts: the cut is
shown to change the reference, so these tests can fail. docs/moe-mla.md: DeepSeek Sparse
Attention. ``DCP_DSA_TRANSFORM_FULL=1`` runs every model x layout x step kind."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

import hf_corpus as C  # noqa: E402
from helpers import assert_runs_match  # noqa: E402

import dcp_compile  # noqa: E402
from dcp_compile import DCPSparseAttentionError  # noqa: E402
from dcp_compile.passes.collectives import role_of  # noqa: E402
from dcp_compile.runtime.names import META_LAYER, Role  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402
from dcp_compile.verify import run_threaded_program  # noqa: E402
from full_runs import full  # noqa: E402

TOPK = 4                       # below every prompt but the 1-token one: the indexer cuts
ATOL = 1e-4
# name -> (model type, config options); GLM-5's second layer reuses the first's selection.
MODELS = {"deepseek_v32": ("deepseek_v32", {}), "glm_moe_dsa": ("glm_moe_dsa", {}),
          "glm5-full-shared": ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}),
          # HY-V4: its own indexer form (RoPE on the last columns, softmax_scale in the head
          # weights), the second layer reusing the first's selection (its indexer_types
          # pattern), attention sinks, a sigmoid output gate and hyper-connections.
          "hy_v4-full-shared": ("hy_v4", {"indexer_types": ["full", "shared"]})}
LAYOUTS = ((4, 2), (8, 4))
# The default run's slice; DCP_DSA_TRANSFORM_FULL=1 runs all sixteen cells.
SLICE = {("decode", "deepseek_v32", 4, 2), ("prefill", "glm5-full-shared", 8, 4),
         ("prefill", "hy_v4-full-shared", 4, 2)}
CELLS = [(mode, m, tp, dcp) for mode in ("decode", "prefill") for m in MODELS
         for tp, dcp in LAYOUTS
         if full("DCP_DSA_TRANSFORM_FULL") or (mode, m, tp, dcp) in SLICE]


def _set_topk(model, k: int) -> None:
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = k


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model_type, options = MODELS[name]
    return C.build(model_type, index_topk=TOPK, **options)


def _transform(model, mode: str, tp: int, dcp: int, check: bool = False, **shape_options):
    blocks = 4 * 2 // dcp + 1
    shapes = StepShapes(batch=len(C.LENGTHS), context_len=max(C.LENGTHS), max_blocks=blocks,
                        num_blocks=blocks * len(C.LENGTHS) + 2, **shape_options)
    return dcp_compile.transform(model, tp=tp, dcp=dcp, mode=mode, block_size=C.BLOCK,
                                 shapes=shapes, check=check)


@functools.lru_cache(maxsize=None)
def _program(mode: str, name: str, tp: int, dcp: int):
    return _transform(_model(name), mode, tp, dcp, check=(mode == "prefill"))


@functools.lru_cache(maxsize=None)
def _decode_program_with_drafts_and_chunks():
    """DeepSeek-V3.2's tp=4/dcp=2 decode program with width-3 decode steps and width-16
    chunk steps, for 4 rows of up to 34 tokens: the speculative test's and the chunk test's
    (one transform for both)."""
    shapes = replace(StepShapes.fitting(4, 20, 34, block_size=C.BLOCK, dcp=2, decode_len=3),
                     chunk_len=16)
    return dcp_compile.transform(_model("deepseek_v32"), tp=4, dcp=2, mode="decode",
                                 block_size=C.BLOCK, shapes=shapes)


def _assert_the_cut_matters(model, steps: int) -> None:
    """The model's own forward with index_topk=4 differs from the same weights reading
    every prior token, on these prompts (so a program ignoring the cut fails)."""
    cut = C.reference(model, C.prompts(), steps)[1]
    _set_topk(model, 10**6)
    try:
        dense = C.reference(model, C.prompts(), steps)[1]
    finally:
        _set_topk(model, TOPK)
    assert max(float((a - b).abs().max()) for a, b in zip(cut, dense)) > 1e-3


def _own_indexer(model) -> list[bool]:
    """Per layer: whether it has its own indexer (GLM-5's "shared" layers reuse one)."""
    types = getattr(model.config, "indexer_types", None) or \
        ["full"] * model.config.num_hidden_layers
    return [t == "full" for t in types]


@pytest.mark.parametrize("mode,name,tp,dcp", CELLS,
                         ids=[f"{a}-{b}-tp{c}-dcp{d}" for a, b, c, d in CELLS])
def test_dsa_program_is_the_models_forward(mode, name, tp, dcp):
    model = _model(name)
    steps = C.STEPS[mode]
    _assert_the_cut_matters(model, steps)
    program = _program(mode, name, tp, dcp)
    # One cache per layer: [latent ; k_pe ; the indexer's K] (the latent alone on a layer
    # reusing another's selection), its halves in the key/value pair, one head.
    c, own = model.config, _own_indexer(model)
    spec = program.cache_spec()
    groups = spec.groups or ()      # None: one layout for every layer
    widths = {i: g.head_dim for g in groups for i in g.caches}
    assert [widths.get(i, spec.head_dim) for i in range(len(own))] == [
        (c.kv_lora_rank + c.qk_rope_head_dim + (c.index_head_dim if o else 0)) // 2
        for o in own]
    assert {g.kv_heads for g in groups} | {spec.kv_heads} == {1}
    runs = run_threaded_program(program, C.prompts(), steps, poison_garbage=True)
    ref_tokens, ref_logits = C.reference(model, C.prompts(), steps)
    worst = assert_runs_match(runs, ref_tokens, ref_logits, atol=ATOL, lengths=C.LENGTHS)
    layers = model.config.num_hidden_layers
    step = "decode" if mode == "decode" else "prefill"
    # Per layer, the DCP rewrite's collectives (op, dtype): MLA's (decode: q all-gather, LSE
    # all-gather, reduce-scatter of the heads; prefill: q all-gather, LSE all-gather, token
    # reduce-scatter) and the selection's one all-gather of the candidates' (score,
    # position) packed as int32, [dcp * b, queries, 2 * candidates] (none on a layer
    # reusing another's selection).
    per_layer = _dcp_collectives(program.graphs[step])
    for layer in range(layers):
        assert sorted(per_layer[layer]) == sorted(
            [("all_gather_into_tensor", "torch.float32")] * 2
            + [("all_gather_into_tensor", "torch.int32")] * own[layer]
            + [("reduce_scatter_tensor", "torch.float32")]), per_layer[layer]
    if mode == "decode":    # the decode engine's prompt step: every key local, no collective
        assert _dcp_collectives(program.graphs["context"]) == {}
    else:                   # transform's own check: two chunks, the second over the first
        report = program.report.check
        assert report.ok and max(report.step_errors) < ATOL, report.step_errors
    print(f"DSA {mode} {name} tp={tp} dcp={dcp}: max |logit error| {worst:.2e}")


def _dcp_collectives(gm) -> dict[int, list]:
    """layer -> [(collective op, input dtype)] of the DCP groups (roles dcp / cp_kv)."""
    out: dict[int, list] = {}
    for n in gm.graph.nodes:
        if role_of(n) in (Role.DCP, Role.CP_KV):
            out.setdefault(n.meta.get(META_LAYER), []).append(
                (n.target._opname, str(n.args[0].meta["val"].dtype)))
    return out


class _OracleDrafter:
    """Drafts the reference's own continuation, its last draft wrong every other call:
    drafts are accepted and rejected (the KV rewound) in the same run."""

    def __init__(self, full: list[list[int]]):
        self.full, self.calls = full, 0

    def propose(self, histories, counts):
        self.calls += 1
        out = []
        for b, (h, c) in enumerate(zip(histories, counts)):
            d = list(self.full[b][len(h):len(h) + c])
            if d and self.calls % 2:
                d[-1] = (d[-1] + 1) % C.TINY["vocab_size"]
            out.append(d)
        return out

    def accepted(self, seq, length):
        pass


def test_speculative_decoding_with_prefix_caching_is_the_models_forward():
    """Width-3 decode steps (each query bounded per rank: the selection per query) verify
    drafts, some accepted and some rejected, while the prefix cache serves a shared
    prompt prefix (its cached [latent ; k_pe ; indexer K] blocks, written once): the
    model's own greedy tokens and logits (fp32, 1e-4)."""
    from dcp_compile.runtime.distributed.world import run_threaded
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    from dcp_compile.verify import generate_per_token
    model, steps = _model("deepseek_v32"), 8
    shared = [5, 9, 5, 9, 5, 9, 11, 12, 13, 5, 9, 14, 15, 16, 17, 5, 9]   # two vblocks + 1
    prompts = [shared + [5, 9], shared + [40], [7, 8, 9, 7, 8, 9, 7], [3]]
    program = _decode_program_with_drafts_and_chunks()
    ref_tokens, ref_logits = C.reference(model, prompts, steps)
    full_ids = [p + t for p, t in zip(prompts, ref_tokens)]

    def rank_main(rank):
        engine = rank_engine(program, rank, poison=True, prefix_caching=True)
        return generate_per_token(engine, prompts, steps, _OracleDrafter(full_ids))

    runs = run_threaded(4, rank_main, timeout=600)
    for got, reused in runs:
        assert got.tokens == ref_tokens and reused == 16          # one follower, 2 vblocks
        assert 0 < got.stats.accepted < got.stats.drafted         # accepted and rejected
        for b, row in enumerate(got.logits):
            for t, logits in enumerate(row):
                assert float((logits - ref_logits[b][t]).abs().max()) <= ATOL


@pytest.mark.parametrize("name,tp,dcp", [("deepseek_v32", 4, 2)] + (
    [("glm5-full-shared", 8, 4)] if full("DCP_DSA_TRANSFORM_FULL") else []))
def test_a_chunk_step_after_prior_context_is_the_models_forward(name, tp, dcp):
    """A decode program's chunk step (StepShapes.chunk_len): row b's first tokens by the
    context step, the rest in one width-16 step, every query selecting over the prior's
    shards and the chunk; priors 1, 7, 8, 9 and chunks 16, 0 (the row sits out), 1, 9:
    every chunk token's logits against the model's own forward over the whole prompt."""
    from dcp_compile.runtime.distributed.world import run_threaded
    from dcp_compile.runtime.serving.rank_engine import rank_engine
    model = _model(name)
    if (name, tp, dcp) == ("deepseek_v32", 4, 2):       # the speculative test's program
        program = _decode_program_with_drafts_and_chunks()
    else:
        blocks = 5 * 2 // dcp + 1
        shapes = StepShapes(batch=4, context_len=12, max_blocks=blocks,
                            num_blocks=blocks * 4 + 4, decode_len=1, chunk_len=16)
        program = dcp_compile.transform(model, tp=tp, dcp=dcp, block_size=C.BLOCK,
                                        shapes=shapes)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, C.TINY["vocab_size"], (n,), generator=gen).tolist()
               for n in (17, 7, 9, 18)]
    prior = [1, 7, 8, 9]

    def rank_main(rank):
        engine = rank_engine(program, rank, shared_names=True, fill=float("nan"), poison=True)
        with torch.no_grad():
            engine.prefill([p[:k] for p, k in zip(prompts, prior)])
            return engine.chunk_rows([p[k:] for p, k in zip(prompts, prior)])

    outs = run_threaded(tp, rank_main, timeout=600)
    with torch.no_grad():
        for b, (p, k) in enumerate(zip(prompts, prior)):
            want = C.hf_logits(model, torch.tensor([p]))[0, k:]
            for got in outs:       # an empty chunk (the row sits out) compares nothing
                assert torch.allclose(got[b, :len(p) - k], want, rtol=0, atol=ATOL), b


def test_the_dsa_program_is_lowerable():
    """The selection orders keys by one distinct integer key per key and a top-k (no
    stable sort, which torch-mlir does not lower): every op of the DSA program's graphs has
    a lowering (the lowering's first check; tests/lowering/test_dsa_xla.py lowers and runs
    the programs on XLA:CPU)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dcp_compile.lowering import check_lowerable
    from dcp_compile.runtime.kernels.sparse_attention import DECOMPOSITIONS
    program = _program("decode", "deepseek_v32", 4, 2)
    for step, gm in program.graphs.items():
        check_lowerable(gm, step)
    dcp = torch.ops.dcp
    s, p = torch.randn(2, 1, 2, 6), torch.arange(6).expand(2, 1, 2, 6)
    for op, args in ((dcp.index_candidates.default, (s[0], p[0])),
                     (dcp.index_threshold.default, (s, p))):
        gm = make_fx(lambda a, b: DECOMPOSITIONS[op](a, b, 3))(*args)
        ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert torch.ops.aten.topk.default in ops and torch.ops.aten.sort.stable not in ops


@pytest.mark.parametrize("live", [False, True], ids=["static", "live"])
def test_index_columns_are_not_attended(live):
    """partial_attention(index_width=w) over [latent ; k_pe ; index K] (halves in the cache
    pair) equals partial_attention over [latent ; k_pe] alone, static and live kernels."""
    g = torch.Generator().manual_seed(0)
    b, h, block, blocks, d, w = 2, 4, 4, 3, 20, 8
    full = torch.randn(blocks * 2 + 1, block, 1, d + w, generator=g)
    cur = torch.randn(b, 1, 1, d + w, generator=g)
    q = torch.randn(b, 1, h, d, generator=g)
    table = torch.tensor([[0, 1, 2], [3, 4, -1]])
    q_pos, prior = torch.tensor([[9], [5]]), torch.tensor([9, 5])
    args = (torch.zeros((), dtype=torch.int64), 1, 1, 0.3)
    op = torch.ops.dcp.partial_attention_live if live else torch.ops.dcp.partial_attention
    half = (d + w) // 2
    got = op(q, q_pos, cur[..., :half], cur[..., half:], q_pos, full[..., :half],
             full[..., half:], table, prior, *args, kv_shared=True, index_width=w)
    ref = op(q, q_pos, cur[..., :d // 2], cur[..., d // 2:d], q_pos, full[..., :d // 2],
             full[..., d // 2:d], table, prior, *args, kv_shared=True)
    for a, r in zip(got, ref):
        assert (a - r).abs().max() <= 1e-6

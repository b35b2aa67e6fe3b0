"""DeepSeek Sparse Attention under DCP, exact (runtime/kernels/sparse_attention.py).

The selection rule (DSA_ORDER: score descending, then position ascending, the first
index_topk) is checked against a brute-force sort and against torch.topk where its cut has
no tie; the DCP form (index_scores over each rank's shard of a real paged cache, local
candidates, the gathered threshold, ``selected``) picks the single-device set, ties
included, also on a threaded world with real all-gathers; and the ops, run per rank on dcp
shards of each DSA layer by the harness below (what the decode / prefill rewrite would emit
per layer), give DeepSeek-V3.2's and GLM-5's own forward: logits within 1e-4 and the same
greedy tokens, with an index_topk that cuts.

The graph rewrite that emits these ops from the captured model is not built: transform
still refuses DSA by name (tests/frontends/test_sparse_attention.py).
"""

from __future__ import annotations

import itertools
from types import MethodType

import pytest
import torch

from dcp_compile.runtime import layout
from dcp_compile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.runtime.kernels import sparse_attention as dsa

from full_runs import full
from helpers import assert_close_report, full_forward_reference, prompts_of

pytest.importorskip("transformers")
import hf_corpus as C  # noqa: E402

dcp_ops = torch.ops.dcp
ATOL = 1e-4
STEPS = 8


def brute_force(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> set[int]:
    """DSA_ORDER on one query, spelled out: selectable keys by (-score, position)."""
    keys = [(-float(s), int(p)) for s, p in zip(scores, positions) if p >= 0]
    return {p for _, p in sorted(keys)[:topk]}


def kept(keep: torch.Tensor, positions: torch.Tensor) -> set[int]:
    return set(positions[keep].tolist())


# ----------------------------------------------------------------------------------------
# The rule on one device
# ----------------------------------------------------------------------------------------


def test_rule_is_torch_topk_where_the_cut_has_no_tie():
    g = torch.Generator().manual_seed(0)
    for n, k in [(17, 4), (9, 9), (5, 8), (64, 16)]:
        scores = torch.randn(3, n, generator=g)
        pos = torch.arange(n).expand(3, n)
        keep = dsa.dsa_select(scores[None], pos[None], k)[0]
        for row in range(3):
            want = set(scores[row].topk(min(k, n)).indices.tolist())
            assert kept(keep[row], pos[row]) == want == brute_force(scores[row], pos[row], k)


def test_rule_breaks_ties_by_position_not_as_torch_topk():
    """The documented case: zeros with every third entry 1, top-4 of 17. torch.topk picks
    {0, 6, 9, 12} (not a rule of positions); DSA_ORDER picks the earliest, {0, 3, 6, 9}."""
    scores = torch.zeros(17)
    scores[::3] = 1
    pos = torch.arange(17)
    keep = dsa.dsa_select(scores[None, None], pos[None, None], 4)[0, 0]
    assert kept(keep, pos) == {0, 3, 6, 9} == brute_force(scores, pos, 4)
    assert set(scores.topk(4).indices.tolist()) != {0, 3, 6, 9}    # why a rule is needed


def test_unselectable_keys_are_never_kept():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    pos = torch.tensor([[0, -1, 2, -1, 4]])
    keep = dsa.dsa_select(scores[None], pos[None], 2)[0, 0]
    assert kept(keep, pos[0]) == {0, 2}
    keep = dsa.dsa_select(scores[None], pos[None], 9)[0, 0]       # fewer than topk: all
    assert kept(keep, pos[0]) == {0, 2, 4}


# ----------------------------------------------------------------------------------------
# The DCP selection over a sharded paged cache equals the single-device one, ties included
# ----------------------------------------------------------------------------------------


def shard_caches(k: torch.Tensor, *, dcp: int, interleave: int, block: int):
    """Every rank's paged cache of one sequence's keys ``k`` [n, d] (the rank's own tokens at
    the runtime's slot mapping) and its one-row block table."""
    n, d = k.shape
    max_blocks = -(-n // (block * dcp)) + 1
    table = torch.arange(max_blocks)[None]
    pos = torch.arange(n)[None]
    caches = []
    for r in range(dcp):
        rank = torch.tensor(r)
        slots = dcp_ops.slot_mapping(pos, table, rank, dcp, interleave, block)
        empty = torch.full((max_blocks + 1, block, 1, d), float("nan"))
        caches.append(dcp_ops.index_cache_write(empty, k[None, :, None], slots))
    return caches, table


def decode_rows(n: int, rank: int, *, dcp: int, interleave: int, block: int):
    """One decode row per query position t < n: q_pos [n, 1], the rank's prior bound, and
    the query's own token as a current key on its owner only (dcp_active_mask)."""
    return step_rows(torch.arange(n)[:, None], rank, dcp=dcp, interleave=interleave,
                     block=block)


def step_rows(tokens: torch.Tensor, rank: int, *, dcp: int, interleave: int, block: int):
    """A step's rows on ``rank``: ``tokens`` [rows, q_len] the positions each row's queries
    are at (-1 padding; a row's positions consecutive). Returns q_pos, the rank's prior bound
    (its local slots before the row's first position) and the current keys' positions (the
    row's own tokens, on their owner only): a decode row (q_len 1) or a prefill chunk."""
    r = torch.tensor(rank)
    prior = dcp_ops.local_filled(tokens[:, 0].clamp(min=0), r, dcp, interleave, block)
    owned = dcp_ops.active_mask(tokens, r, dcp, interleave, block)
    return tokens, prior, torch.where(owned == 1, tokens, -1)


def dcp_select(index_q, weights, k, *, topk, dcp, interleave, block, scale=1.0):
    """Each rank's (scores, positions, keep) for every query position, through the ops the
    decode rewrite emits; the all-gather of the candidates is a stack over the ranks."""
    n = k.shape[0]
    caches, table = shard_caches(k, dcp=dcp, interleave=interleave, block=block)
    per_rank = []
    for r in range(dcp):
        q_pos, prior, k_pos = decode_rows(n, r, dcp=dcp, interleave=interleave, block=block)
        s, p = dcp_ops.index_scores(index_q[:, None], weights[:, None], k[:, None, None],
                                    k_pos, caches[r], table.expand(n, -1), prior, q_pos,
                                    torch.tensor(r), dcp, interleave, scale)
        per_rank.append((s, p, dcp_ops.index_candidates(s, p, topk)))
    thr_s, thr_p = dcp_ops.index_threshold(torch.stack([c[0] for _, _, c in per_rank]),
                                           torch.stack([c[1] for _, _, c in per_rank]), topk)
    return [(s, p, dsa.selected(s, p, thr_s, thr_p)) for s, p, _ in per_rank]


def integer_indexer(n, *, heads=3, dim=4, levels=2, seed=0):
    """Indexer inputs with small integer entries: every score is exact in float32, and with
    few levels many keys score the same (ties at the cut)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, levels, (n, heads, dim), generator=g).float()
    k = torch.randint(0, levels, (n, dim), generator=g).float()
    w = torch.randint(1, 3, (n, heads), generator=g).float()
    return q, w, k


CASES = [  # (dcp, interleave, block, n, topk, levels): id names the edge
    pytest.param(2, 1, 4, 17, 4, 2, id="dcp2-i1-cut-ties"),
    pytest.param(2, 4, 4, 17, 4, 2, id="dcp2-i4-cut-ties"),
    pytest.param(4, 1, 2, 23, 5, 2, id="dcp4-i1-cut-ties"),
    pytest.param(4, 2, 2, 23, 3, 3, id="dcp4-i2-cut-ties"),
    pytest.param(2, 1, 4, 9, 16, 2, id="dcp2-no-cut"),
    pytest.param(4, 1, 4, 13, 13, 5, id="dcp4-topk=len"),
    pytest.param(4, 1, 4, 40, 6, 50, id="dcp4-cut-few-ties"),
]


@pytest.mark.parametrize("dcp,interleave,block,n,topk,levels", CASES)
def test_dcp_selection_is_the_single_device_one(dcp, interleave, block, n, topk, levels):
    q, w, k = integer_indexer(n, levels=levels)
    ranks = dcp_select(q, w, k, topk=topk, dcp=dcp, interleave=interleave, block=block)
    full = torch.einsum("ihd,jd->ihj", q, k).relu().mul(w[:, :, None]).sum(1)   # [n, n]
    ties_at_cut = 0
    for t in range(n):
        prior = torch.arange(t + 1)
        want = brute_force(full[t, :t + 1], prior, topk)
        got = set().union(*(kept(keep[t, 0], p[t, 0]) for _, p, keep in ranks))
        assert got == want, f"query {t}: {sorted(got)} != {sorted(want)}"
        # every rank's scores are the single device's at the positions it holds
        for s, p, _ in ranks:
            held = p[t, 0] >= 0
            assert torch.equal(s[t, 0][held], full[t, p[t, 0][held]])
        if t + 1 > topk:
            ordered = full[t, :t + 1].sort(descending=True).values
            ties_at_cut += bool(ordered[topk - 1] == ordered[topk])
    if levels <= 3 and topk < n:
        assert ties_at_cut > 0, "the case meant to tie at the cut has no tie there"


def test_every_rank_holds_its_own_tokens_only():
    """The shards partition the sequence: each position is selectable on exactly one rank."""
    q, w, k = integer_indexer(19)
    ranks = dcp_select(q, w, k, topk=100, dcp=4, interleave=2, block=2)
    for t in range(19):
        held = sorted(itertools.chain(*(p[t, 0][p[t, 0] >= 0].tolist() for _, p, _ in ranks)))
        assert held == list(range(t + 1))


# ----------------------------------------------------------------------------------------
# DeepSeek-V3.2 and GLM-5: the model's own forward, with the DSA layers run on dcp shards
# ----------------------------------------------------------------------------------------


# The indexer's RoPE, as each modeling file applies it (DeepSeek-V3.2 half-split, GLM-5
# interleaved pairs).
INDEXER_ROPE = {"deepseek_v32": "apply_rotary_pos_emb",
                "glm_moe_dsa": "apply_rotary_pos_emb_interleave"}


def _modeling(model_type):
    import importlib
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def dcp_dsa_forward(model_type: str, *, tp: int, dcp: int, interleave: int, block: int,
                    chunk: int = 0, threshold=dcp_ops.index_threshold):
    """A DSA attention layer's forward that runs its core on ``dcp`` shards the decode
    rewrite's way, each query as its own decode row (``chunk`` 0), or the sequence in prefill
    chunks of ``chunk`` tokens, each attending to the chunks before it and causally within
    itself (the dcp_prefill rewrite's keys: the prior shard plus the chunk's owned tokens):
    the layer's own projections and RoPE;
    the latent [RMSNorm(latent) ; k_pe] and the indexer's K written by their owners
    (slot_mapping); per TP head group of ``tp // dcp``, on each cp rank: index_scores over
    the local shard, index_candidates, (all-gather), index_threshold, selected,
    partial_attention(keep=) over the absorbed q; the LSE combine (lse_correct, summed);
    W_UV and o_proj. The indexer is replicated (every rank scores all its heads)."""
    M = _modeling(model_type)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
        b, n, _ = hidden_states.shape
        assert b == 1, "one sequence per call (the model's own forward here)"
        heads, L, dr = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        dn, dv = self.qk_nope_head_dim, self.v_head_dim
        cos, sin = position_embeddings
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid).view(b, n, heads, dn + dr).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [dn, dr], dim=-1)
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [L, dr], dim=-1)
        latent = self.kv_a_layernorm(kv_pass).view(b, 1, n, L)
        q_rot, k_rot = M.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, n, dr),
                                                         cos, sin)
        w = self.kv_b_proj.weight.view(heads, dn + dv, L)
        q_abs = torch.cat([torch.einsum("bhsn,hnl->bhsl", q_pass, w[:, :dn]), q_rot], -1)
        q_abs = q_abs[0].transpose(0, 1)                                   # [n, H, L+dr]
        kv = torch.cat([latent, k_rot], dim=-1)[0, 0]                      # [n, L+dr]
        half = (L + dr) // 2
        shared = self.indexer is None
        if not shared:
            idx = self.indexer
            iq = idx.wq_b(q_resid).view(b, n, idx.n_heads, idx.head_dim)
            iq_rot, iq_pass = torch.split(iq, [dr, idx.head_dim - dr], dim=-1)
            ik = idx.k_norm(idx.wk(hidden_states)).unsqueeze(2)
            ik_rot, ik_pass = torch.split(ik, [dr, idx.head_dim - dr], dim=-1)
            iq_rot, ik_rot = getattr(M, INDEXER_ROPE[model_type])(iq_rot, ik_rot, cos, sin,
                                                                  unsqueeze_dim=2)
            iq = torch.cat([iq_rot, iq_pass], -1)[0]                       # [n, Hi, Di]
            ik = torch.cat([ik_rot, ik_pass], -1)[0, :, 0]                 # [n, Di]
            iw = (idx.weights_proj(hidden_states).float() * idx.n_heads ** -0.5)[0]
        tokens = (torch.arange(n)[:, None] if not chunk else
                  torch.arange(-(-n // chunk) * chunk).view(-1, chunk))
        tokens = torch.where(tokens < n, tokens, -1)                      # [rows, q_len]
        at = tokens.clamp(min=0)
        caches, table = shard_caches(torch.zeros(n, 1), dcp=dcp, interleave=interleave,
                                     block=block)
        table = table.expand(tokens.shape[0], -1)
        pos = torch.arange(n)[None]
        ranks = []
        for r in range(dcp):
            rank = torch.tensor(r)
            slots = dcp_ops.slot_mapping(pos, table[:1], rank, dcp, interleave, block)
            nb = table.shape[1] + 1
            kc, vc = dcp_ops.cache_write(torch.zeros(nb, block, 1, half),
                                         torch.zeros(nb, block, 1, half),
                                         kv[None, :, None, :half], kv[None, :, None, half:],
                                         slots)
            q_pos, prior, k_pos = step_rows(tokens, r, dcp=dcp, interleave=interleave,
                                            block=block)
            rank_state = dict(rank=rank, kc=kc, vc=vc, q_pos=q_pos, prior=prior, k_pos=k_pos)
            if not shared:
                icache = dcp_ops.index_cache_write(torch.zeros(nb, block, 1, idx.head_dim),
                                                   ik[None, :, None], slots)
                s, p = dcp_ops.index_scores(iq[at], iw[at], ik[at][:, :, None], k_pos, icache,
                                            table, prior, q_pos, rank, dcp, interleave,
                                            idx.softmax_scale)
                rank_state.update(s=s, p=p, cand=dcp_ops.index_candidates(s, p,
                                                                          idx.index_topk))
            ranks.append(rank_state)
        if shared:   # GLM-5 "shared" layers: the previous full layer's selection, per rank
            keeps = prev_topk_indices
        else:
            thr = threshold(torch.stack([x["cand"][0] for x in ranks]),
                                          torch.stack([x["cand"][1] for x in ranks]),
                                          idx.index_topk)
            keeps = [dsa.selected(x["s"], x["p"], *thr) for x in ranks]
        group = heads * dcp // tp                 # a rank's heads after the Q all-gather
        outs = []
        for g0 in range(0, heads, group):
            parts = []
            for x, keep in zip(ranks, keeps):
                parts.append(dcp_ops.partial_attention(
                    q_abs[at][:, :, g0:g0 + group].contiguous(), x["q_pos"],
                    kv[at][:, :, None, :half], kv[at][:, :, None, half:], x["k_pos"],
                    x["kc"], x["vc"], table, x["prior"], x["rank"], dcp, interleave,
                    self.scaling, kv_shared=True, keep=keep))
            lse_all = torch.stack([lse for _, lse in parts])
            outs.append(sum(dcp_ops.lse_correct(o, lse, lse_all) for o, lse in parts))
        rows = torch.cat(outs, dim=2)[..., :L]                        # [rows, q_len, H, L]
        out = rows[tokens >= 0][tokens[tokens >= 0].argsort()]               # [n, H, L]
        attn = torch.einsum("shl,hvl->shv", out, w[:, dn:]).reshape(b, n, heads * dv)
        attn = self.o_proj(attn.to(hidden_states.dtype))
        return (attn, None, keeps) if model_type == "glm_moe_dsa" else (attn, None)

    return forward


def dcp_model(model, *, tp, dcp, interleave=1, block=4, **options):
    """``model`` with every DSA layer's forward replaced by ``dcp_dsa_forward``."""
    fwd = dcp_dsa_forward(model.config.model_type, tp=tp, dcp=dcp, interleave=interleave,
                          block=block, **options)
    for layer in model.model.layers:
        layer.self_attn.forward = MethodType(fwd, layer.self_attn)
    return model


LAYOUTS = {"tp4-dcp2": (4, 2, 1, 4), "tp8-dcp4": (8, 4, 1, 2), "tp4-dcp2-i2": (4, 2, 2, 2)}
MODELS = {"deepseek_v32": ("deepseek_v32", {}),
          "glm5-full-shared": ("glm_moe_dsa", {"indexer_types": ["full", "shared"]})}
STEP_KINDS = {"decode": 0, "prefill-chunk3": 3}     # chunk 0: one decode row per query
PROMPTS = (1, 13)                # index_topk=4: no cut until 4 tokens, then cuts at every step
# The default run's slice: both models, both step kinds, both tp/dcp; DCP_DSA_FULL=1 runs
# every layout x model x step kind.
SLICE = {("tp4-dcp2", "deepseek_v32", "decode"), ("tp8-dcp4", "glm5-full-shared", "decode"),
         ("tp8-dcp4", "deepseek_v32", "prefill-chunk3"),
         ("tp4-dcp2-i2", "glm5-full-shared", "prefill-chunk3")}
CELLS = [pytest.param(*LAYOUTS[lay], *MODELS[mod], STEP_KINDS[kind], id=f"{lay}-{mod}-{kind}")
         for lay, mod, kind in itertools.product(LAYOUTS, MODELS, STEP_KINDS)
         if full("DCP_DSA_FULL") or (lay, mod, kind) in SLICE]


@pytest.mark.parametrize("tp,dcp,interleave,block,model_type,extra,chunk", CELLS)
def test_dsa_on_shards_is_the_models_own_forward(tp, dcp, interleave, block, model_type,
                                                 extra, chunk):
    own = C.build(model_type, "eager", index_topk=4, **extra)
    sharded = dcp_model(C.build(model_type, "eager", index_topk=4, **extra), tp=tp, dcp=dcp,
                        interleave=interleave, block=block, chunk=chunk)
    prompts = prompts_of(PROMPTS)
    ref_tokens, ref_logits = full_forward_reference(own, prompts, STEPS)
    tokens, logits = full_forward_reference(sharded, prompts, STEPS)
    assert tokens == ref_tokens
    worst = max(assert_close_report(got, want, atol=ATOL, what=f"{model_type} len={n}")
                for got, want, n in zip(logits, ref_logits, PROMPTS))
    assert worst < ATOL


def test_the_harness_would_see_a_wrong_selection():
    """Not a test that cannot fail: the same shards with a threshold from rank 0's candidates
    alone (no gathered merge) leave the model's forward once the indexer cuts."""
    model = C.build("deepseek_v32", "eager", index_topk=4)
    ids = torch.tensor([prompts_of((17,))[0]])
    with torch.no_grad():
        want = model(ids).logits

    def rank0_threshold(cand_scores, cand_pos, topk):   # rank 0's candidates alone decide
        return dcp_ops.index_threshold(cand_scores[:1], cand_pos[:1], topk)

    dcp_model(model, tp=4, dcp=2, threshold=rank0_threshold)
    with torch.no_grad():
        wrong = model(ids).logits
    assert (wrong - want).abs().max() > 1e-3


def test_the_index_cache_is_sharded_like_the_latent_cache():
    """The indexer's K of position t lives on owner(t), in the same local slot as its latent."""
    n, dcp, interleave, block = 21, 2, 2, 4
    k = torch.arange(n, dtype=torch.float32)[:, None]
    caches, table = shard_caches(k, dcp=dcp, interleave=interleave, block=block)
    for t in range(n):
        r = layout.owner(t, dcp=dcp, interleave=interleave, block=block)
        slot = layout.local_slot(t, dcp=dcp, interleave=interleave, block=block)
        assert caches[r][slot // block, slot % block, 0, 0] == t


def test_eager_kernel_keeps_the_same_keys():
    """partial_attention_live (the eager backend's kernel) applies ``keep`` as the reference
    does, on its live span and the current keys; and ``keep`` changes the result."""
    from helpers import assert_live_kernel_matches_reference
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(2, 1, 4 * 4 + 1, generator=g) > 0.4      # helper's batch: 4 x 4 + 1
    assert_live_kernel_matches_reference(keep=keep)
    with pytest.raises(AssertionError):
        _assert_keep_changes_nothing(keep)


def _assert_keep_changes_nothing(keep):
    """The reference with ``keep`` equals it without (raises when they differ)."""
    from dcp_compile.runtime.kernels.ops import _partial_attention_impl
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 4, 8, generator=g)
    kc, vc = (torch.randn(9, 4, 2, 8, generator=g) for _ in range(2))
    k_cur, v_cur = (torch.randn(2, 1, 2, 8, generator=g) for _ in range(2))
    table = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1]])
    prior, q_pos = torch.tensor([9, 5]), torch.tensor([[18], [11]])
    args = (q, q_pos, k_cur, v_cur, q_pos, kc, vc, table, prior, torch.tensor(1), 2, 2, 0.35)
    assert_close_report(_partial_attention_impl(*args, keep=keep)[0],
                        _partial_attention_impl(*args)[0], atol=1e-5)


def test_decompositions_are_static_aten():
    """The selection's decompositions (what a lowering uses) trace to ATen with static shapes,
    and the traced graph selects what the ops do (a tie case)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from dcp_compile.runtime.kernels.ops import DECOMPOSITIONS
    q, w, k = integer_indexer(11)
    caches, table = shard_caches(k, dcp=2, interleave=1, block=2)
    q_pos, prior, k_pos = decode_rows(11, 1, dcp=2, interleave=1, block=2)

    def select(q, w, k_cur, k_pos, cache, table, prior, q_pos, rank):
        s, p = dcp_ops.index_scores(q, w, k_cur, k_pos, cache, table, prior, q_pos, rank,
                                    2, 1, 1.0)
        cs, cp = dcp_ops.index_candidates(s, p, 3)
        thr = dcp_ops.index_threshold(torch.stack([cs, cs]), torch.stack([cp, cp]), 3)
        return dsa.selected(s, p, *thr)

    args = (q[:, None], w[:, None], k[:, None, None], k_pos, caches[1], table.expand(11, -1),
            prior, q_pos, torch.tensor(1))
    gm = make_fx(select, decomposition_table=DECOMPOSITIONS)(*args)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("dcp." in t or "nonzero" in t for t in targets), targets
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            assert all(isinstance(s, int) for s in v.shape), n
    assert torch.equal(gm(*args), select(*args))


@pytest.mark.parametrize("dcp", [2, 4])
def test_selection_over_a_threaded_world_with_real_collectives(dcp):
    """Each rank on its own thread holds only its shard; the candidates move by the
    functional all_gather_into_tensor the decode rewrite emits. Every rank derives the
    same threshold (bit for bit) and the ranks' kept keys are the single-device set."""
    import torch.distributed as dist
    from dcp_compile.runtime.distributed.world import run_threaded
    n, topk, interleave, block = 21, 4, 1, 2
    q, w, k = integer_indexer(n, levels=2, seed=3)
    caches, table = shard_caches(k, dcp=dcp, interleave=interleave, block=block)
    F = torch.ops._c10d_functional

    def gathered(x):
        out = F.all_gather_into_tensor(x.contiguous(), dcp, dist.group.WORLD.group_name)
        return F.wait_tensor(out).view(dcp, *x.shape)

    def rank_main(r):
        q_pos, prior, k_pos = decode_rows(n, r, dcp=dcp, interleave=interleave, block=block)
        s, p = dcp_ops.index_scores(q[:, None], w[:, None], k[:, None, None], k_pos,
                                    caches[r], table.expand(n, -1), prior, q_pos,
                                    torch.tensor(r), dcp, interleave, 1.0)
        cs, cp = dcp_ops.index_candidates(s, p, topk)
        thr = dcp_ops.index_threshold(gathered(cs), gathered(cp), topk)
        keep = dsa.selected(s, p, *thr)
        return thr, [kept(keep[t, 0], p[t, 0]) for t in range(n)]

    results = run_threaded(dcp, rank_main)
    full = torch.einsum("ihd,jd->ihj", q, k).relu().mul(w[:, :, None]).sum(1)
    for thr, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(thr, results[0][0]))
    for t in range(n):
        got = set().union(*(sets[t] for _, sets in results))
        assert got == brute_force(full[t, :t + 1], torch.arange(t + 1), topk), f"query {t}"


@pytest.mark.parametrize("width", [2, 4])
def test_width_k_decode_selection(width):
    """A speculative step (width K: every key read from the cache, query i bounded by its own
    query_bound, no current key) selects, per query, the single-device set too."""
    n, dcp, interleave, block, topk = 19, 2, 1, 2, 4
    q, w, k = integer_indexer(n, levels=2, seed=7)
    caches, table = shard_caches(k, dcp=dcp, interleave=interleave, block=block)
    tokens = torch.arange(width - 1, n)[:, None] - torch.arange(width - 1, -1, -1)[None]
    rows = tokens.shape[0]
    per_rank = []
    for r in range(dcp):
        rank = torch.tensor(r)
        bound = dcp_ops.query_bound(tokens, rank, dcp, interleave, block)     # [rows, K]
        s, p = dcp_ops.index_scores(q[tokens], w[tokens], torch.zeros(rows, 1, 1, 4),
                                    torch.full((rows, 1), -1), caches[r],
                                    table.expand(rows, -1), bound, tokens, rank, dcp,
                                    interleave, 1.0)
        per_rank.append((s, p, dcp_ops.index_candidates(s, p, topk)))
    thr = dcp_ops.index_threshold(torch.stack([c[0] for _, _, c in per_rank]),
                                  torch.stack([c[1] for _, _, c in per_rank]), topk)
    full = torch.einsum("ihd,jd->ihj", q, k).relu().mul(w[:, :, None]).sum(1)
    for row, i in itertools.product(range(rows), range(width)):
        t = int(tokens[row, i])
        got = set().union(*(kept(dsa.selected(s, p, *thr)[row, i], p[row, i])
                            for s, p, _ in per_rank))
        assert got == brute_force(full[t, :t + 1], torch.arange(t + 1), topk), (row, i)

"""Prefill step time: transformed program vs a hand-written eager prefill DCP vs single device;
collectives per layer vs the specification's pattern.

The hand-written version is written here from the specification's "DCP Prefill" Compute
Pattern and "Segmented Attention CP" (it does not use the passes or the dcp ops): residual
stream S/TP per rank, SP all-gather (world), interleave slice by ``view(S // (W*I), W, I)[:, R,
:]`` (so it needs an aligned prior and a full chunk — the benchmark gives it one), QKV with
dcp_tp-sharded weights, cache write of the owned slots, Q all-gather (cp_kv) + unshuffle,
attention over the local prior cache + own keys with global-position causality, LSE
all-gather + correction, reduce-scatter (cp_kv), O projection + reduce-scatter (dcp_tp), MLP
with all-gather / reduce-scatter over world. Both DCP versions run the *second* chunk of a
chunked prefill (prior = S tokens already cached) in the same threaded world on the same
weights and caches; the single-device model runs the same step eagerly in this process.

    python3 benchmarks/bench_prefill.py [--tp 8 --dcp 4 --block 16 --chunk 128 --batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import dcp_compile
from dcp_compile.runtime import layout
from dcp_compile.models.demo import DemoConfig, demo_model, rope_cos_sin, rotate_half
from dcp_compile.runtime.serving.rank_engine import RecordingExecutor
from dcp_compile.verify import run_chunks
from dcp_compile.passes.collectives import collective_summary
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes
from dcp_compile.runtime.serving.kv_cache import KVCacheSpec
from dcp_compile.runtime.serving.rank_engine import load_rank
from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

FC = torch.ops._c10d_functional


def _ag_tokens(x, n, group):
    """[b, s, ...] on n ranks -> [b, n*s, ...] (rank order along tokens)."""
    y = FC.wait_tensor(FC.all_gather_into_tensor(x.contiguous(), n, group))
    return y.view(n, *x.shape).transpose(0, 1).reshape(x.shape[0], n * x.shape[1],
                                                        *x.shape[2:])


def _rs_tokens(x, n, group):
    """Sum [b, S, ...] over n ranks; keep this rank's contiguous S/n tokens."""
    b, s = x.shape[:2]
    y = x.reshape(b, n, s // n, *x.shape[2:]).transpose(0, 1).reshape(n * b, s // n,
                                                                       *x.shape[2:])
    return FC.wait_tensor(FC.reduce_scatter_tensor(y.contiguous(), "sum", n, group))


def hand_written_step(model, rank, tp, W, I, groups, ids, pos, table, caches):
    """One prefill chunk of the demo model on ``rank``, from the spec, eager. Requires the
    chunk to be full (S tokens per row) and to start at a multiple of W*I."""
    c = model.config
    b, S = ids.shape
    sub = tp // W                              # dcp_tp_group size
    t, cp = rank % sub, rank // sub            # dcp_tp rank, cp_rank = tp_rank // (TP/DCP)
    hq, d = c.num_q_heads // sub, c.head_dim
    hkv = max(1, c.num_kv_heads // sub)
    kv0 = t * hkv if c.num_kv_heads >= sub else t // (sub // c.num_kv_heads)
    vocab = c.vocab_size // tp
    block = I
    # Embedding (vocab-parallel over world), reduce-scattered to S/TP tokens.
    local = ids - rank * vocab
    inside = (local >= 0) & (local < vocab)
    x = F.embedding(torch.where(inside, local, 0),
                    model.embed_tokens.weight[rank * vocab:(rank + 1) * vocab])
    x = _rs_tokens(x * inside[..., None], tp, groups["world"])          # [b, S/TP, H]
    cos, sin = rope_cos_sin(pos, model.inv_freq, x.dtype)

    def own(t_):   # 2. interleave slice: view(S // (W*I), W, I)[:, R, :]
        return t_.reshape(b, S // (W * I), W, I, *t_.shape[2:])[:, :, cp].reshape(
            b, S // W, *t_.shape[2:])

    pos_own, cos_own, sin_own = own(pos), own(cos), own(sin)
    prior = pos[:, 0]
    prior_local = prior // W                   # aligned prior: S_prior / DCP slots
    # 4. slot mapping extracted from the full mapping with the same pattern (model runner)
    kw = dict(dcp=W, interleave=I, block=block)
    ls = layout.local_slot(pos, **kw)
    full_slots = table.gather(1, ls // block) * block + ls % block
    full_slots = torch.where(layout.owner(pos, **kw) == cp, full_slots, -1)
    slots = own(full_slots)
    unshuffle = layout.q_unshuffle_index(torch.arange(S), S, dcp=W, interleave=I)
    slot_ids = torch.arange(table.shape[1] * block)
    rows = table.clamp(min=0)[:, slot_ids // block] * block + slot_ids % block
    prior_pos = layout.global_position(slot_ids, cp, dcp=W, interleave=I)
    prior_valid = slot_ids[None] < prior_local[:, None]
    new_caches = []
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        h = _ag_tokens(layer.input_layernorm(x), tp, groups["world"])   # 1. [b, S, H]
        h = own(h)                                                         # 2. [b, S/W, H]
        q = F.linear(h, a.q_proj.weight[t * hq * d:(t + 1) * hq * d]).view(b, S // W, hq, d)
        k = F.linear(h, a.k_proj.weight[kv0 * d:(kv0 + hkv) * d]).view(b, S // W, hkv, d)
        v = F.linear(h, a.v_proj.weight[kv0 * d:(kv0 + hkv) * d]).view(b, S // W, hkv, d)
        q = q * cos_own + rotate_half(q) * sin_own                         # 3.
        k = k * cos_own + rotate_half(k) * sin_own
        kc, vc = caches[2 * i].clone(), caches[2 * i + 1].clone()          # 4.
        kc.view(-1, hkv, d)[slots.reshape(-1)] = k.reshape(-1, hkv, d)
        vc.view(-1, hkv, d)[slots.reshape(-1)] = v.reshape(-1, hkv, d)
        qa = FC.wait_tensor(FC.all_gather_into_tensor(q.contiguous(), W, groups["cp_kv"]))
        qa = qa.view(W, b, S // W, hq, d).transpose(0, 1).reshape(b, S, hq, d)  # 5.
        qa = qa[:, unshuffle]                                              # 6.
        # 7. segmented attention: prior (local cache) + current own keys, global positions
        keys = torch.cat([kc.view(-1, hkv, d)[rows], k], 1)
        vals = torch.cat([vc.view(-1, hkv, d)[rows], v], 1)
        kpos = torch.cat([torch.where(prior_valid, prior_pos[None], -1), pos_own], 1)
        allowed = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= pos[:, :, None])
        vals = torch.where((kpos >= 0)[..., None, None], vals, 0.0)
        g = hq // hkv
        s = torch.einsum("bikgd,bjkd->bkgij", qa.view(b, S, hkv, g, d), keys) * a.scale
        s = s.masked_fill(~allowed[:, None, None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        o = torch.einsum("bkgij,bjkd->bikgd", p, vals).reshape(b, S, hq, d)
        lse = lse.permute(0, 3, 1, 2).reshape(b, S, hq)
        lse_all = FC.wait_tensor(FC.all_gather_into_tensor(lse.contiguous(), W,
                                                           groups["cp_kv"])).view(W, b, S, hq)
        glob = torch.logsumexp(lse_all, 0)
        w = torch.where(torch.isfinite(lse) & torch.isfinite(glob), torch.exp(lse - glob), 0.0)
        o = _rs_tokens(o * w[..., None], W, groups["cp_kv"])               # 8. [b, S/W, ...]
        o = F.linear(o.reshape(b, S // W, hq * d),
                     a.o_proj.weight[:, t * hq * d:(t + 1) * hq * d])
        x = x + _rs_tokens(o, sub, groups["dcp_tp"])                       # 9. [b, S/TP, H]
        m = layer.mlp
        inter = c.intermediate_size // tp
        sl = slice(rank * inter, (rank + 1) * inter)
        h = _ag_tokens(layer.post_attention_layernorm(x), tp, groups["world"])
        gu = F.silu(F.linear(h, m.gate_proj.weight[sl])) * F.linear(h, m.up_proj.weight[sl])
        x = x + _rs_tokens(F.linear(gu, m.down_proj.weight[:, sl]), tp, groups["world"])
        new_caches += [kc, vc]
    h = _ag_tokens(model.norm(x), tp, groups["world"])
    logits = F.linear(h, model.lm_head.weight[rank * vocab:(rank + 1) * vocab])
    logits = FC.wait_tensor(FC.all_gather_into_tensor(logits, tp, groups["world"]))
    logits = logits.view(tp, b, S, vocab).permute(1, 2, 0, 3).reshape(b, S, -1)
    return logits, new_caches


def timed(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] if len(times) > 4 else times)


def spec_pattern(b, S, H, hq, d, tp, W, elt, lse_elt=4):
    """Collectives per layer of the spec's pattern, (op, role, bytes in per rank)."""
    return [("all_gather", "world", b * S // tp * H * elt, "1. SP all-gather"),
            ("all_gather", "cp_kv", b * S // W * hq * d * elt, "5. Q all-gather"),
            ("all_gather", "cp_kv", b * S * hq * lse_elt, "7. LSE all-gather"),
            ("reduce_scatter", "cp_kv", b * S * hq * d * elt, "8. output reduce-scatter"),
            ("reduce_scatter", "dcp_tp", b * S // W * H * elt, "9. O-proj reduce-scatter"),
            ("all_gather", "world", b * S // tp * H * elt, "MLP all-gather"),
            ("reduce_scatter", "world", b * S * H * elt, "MLP reduce-scatter")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--dcp", type=int, default=4)
    ap.add_argument("--block", type=int, default=16, help="= interleave size (DI)")
    ap.add_argument("--chunk", type=int, default=128, help="S, a multiple of lcm(TP, W*I)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=12)
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_prefill", args.write_docs):
        tp, W, I, S, b = args.tp, args.dcp, args.block, args.chunk, args.batch
        torch.set_num_threads(1)
        model = demo_model(DemoConfig(num_layers=args.layers))
        shapes = StepShapes.fitting(b, S, 2 * S, block_size=I, dcp=W)
        t0 = time.perf_counter()
        prog = dcp_compile.transform(model, tp=tp, dcp=W, mode="prefill", block_size=I,
                                     shapes=shapes)
        t_transform = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        chunk1 = [torch.randint(0, 256, (S,), generator=g).tolist() for _ in range(b)]
        chunk2 = torch.randint(0, 256, (b, S), generator=g)
        pos2 = torch.arange(S, 2 * S).repeat(b, 1)

        def rank_main(rank):
            names = bind_roles(prog.topology, rank)     # the hand-written step's groups too
            loaded = load_rank(prog, rank, names)
            rec = RecordingExecutor(LocalExecutor(loaded.step_fns(),
                                                  prog.cache_spec().allocate()))
            eng = Engine(rec, shapes, block_size=I, dcp=W, prompt_kind="prefill")
            with torch.no_grad():
                run_chunks(eng, rec, [chunk1], rank, shapes.max_blocks)      # the prior: S tokens
                for s in range(b):
                    eng.allocator.ensure(s, 2 * S)
                table = eng.allocator.table(list(range(b)), shapes.max_blocks)
                caches = list(rec.caches)
                t_prog = timed(lambda: loaded.run("prefill", chunk2, pos2, table, caches),
                               args.reps)
                t_hand = timed(lambda: hand_written_step(model, rank, tp, W, I, names, chunk2,
                                                         pos2, table, caches), args.reps)
                got, _ = loaded.run("prefill", chunk2, pos2, table, caches)
                hand, _ = hand_written_step(model, rank, tp, W, I, names, chunk2, pos2, table,
                                            caches)
            return t_prog, t_hand, got, float((got - hand).abs().max())

        res = run_threaded(tp, rank_main, timeout=900)
        t_prog, t_hand, got, diff_hand = res[0]

        c = model.config
        ref_shapes = StepShapes(b, S, shapes.max_blocks * W, (shapes.num_blocks - 1) * W + 1)
        spec = KVCacheSpec(args.layers, ref_shapes.num_blocks, I, c.num_kv_heads, c.head_dim)
        ex = LocalExecutor(model, spec.allocate())
        eng = Engine(ex, ref_shapes, block_size=I, prompt_kind="prefill")
        with torch.no_grad():
            eng.prefill(chunk1)
            for s in range(b):
                eng.allocator.ensure(s, 2 * S)
            table = eng.allocator.table(list(range(b)), ref_shapes.max_blocks)
            caches = list(ex.caches)
            t_single = timed(lambda: model(chunk2, pos2, table, caches), args.reps)
            ref, _ = model(chunk2, pos2, table, caches)
        diff_ref = float((got - ref).abs().max())

        print(f"prefill step (second chunk, prior = {S} tokens), demo model ({args.layers} "
              f"layers), batch={b}, S={S}, tp={tp}, dcp={W}, interleave=block={I}; {tp} ranks on "
              f"threads of one 2-core machine; transform took {t_transform:.1f} s")
        print(f"{'version':<30} {'ms/step':>9} {'vs hand-written':>16} {'vs single device':>17}")
        for name, t in (("transformed program", t_prog), ("hand-written eager (spec)", t_hand),
                        ("single device (eager)", t_single)):
            print(f"{name:<30} {t * 1e3:>9.2f} {t / t_hand:>16.2f} {t / t_single:>17.2f}")
        print(f"max |logits(program) - hand-written| = {diff_hand:.2e}, "
              f"|logits(program) - single device| = {diff_ref:.2e}")

        gm = prog.graphs["prefill"]
        per_layer = defaultdict(list)
        model_level = []
        for col in collective_summary(gm):
            (per_layer[col["layer"]] if col["layer"] is not None else model_level).append(col)
        hq = c.num_q_heads // (tp // W)
        want = spec_pattern(b, S, c.hidden_size, hq, c.head_dim, tp, W, 4)
        got0 = [(x["op"].replace("_into_tensor", "").replace("_tensor", ""), x["role"],
                 x["bytes_in"]) for x in per_layer[0]]
        print(f"\ncollectives per layer (layer 0 of {args.layers}; every layer is the same: "
              f"{all(len(per_layer[i]) == len(per_layer[0]) for i in range(args.layers))})")
        print(f"{'spec step':<26} {'spec op@role':<22} {'spec bytes':>11} {'program op@role':<22} "
              f"{'bytes':>11}")
        for k in range(max(len(want), len(got0))):
            w = want[k] if k < len(want) else ("-", "-", 0, "(not in spec)")
            g_ = got0[k] if k < len(got0) else ("-", "-", 0)
            print(f"{w[3]:<26} {w[0] + '@' + w[1]:<22} {w[2]:>11} {g_[0] + '@' + g_[1]:<22} "
                  f"{g_[2]:>11}")
        tot_w, tot_g = sum(w[2] for w in want), sum(g_[2] for g_ in got0)
        print(f"{'total per layer':<26} {len(want):<22} {tot_w:>11} {len(got0):<22} {tot_g:>11} "
              f"(ratio {tot_g / tot_w:.2f})")
        print("model level (embedding reduce-scatter, final gathers): "
              + ", ".join(f"{x['op']}@{x['role']} {x['bytes_in']} B" for x in model_level))


if __name__ == "__main__":
    main()

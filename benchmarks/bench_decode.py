"""Decode step time: transformed program vs a hand-written eager DCP decode vs single device.

The hand-written version is written here from the specification's "Decode Compute Pattern"
(it does not use the passes): TP-sharded projections, owner-only cache write, Q all-gather,
local attention with the local_filled prior mask and the dcp_active_mask-gated active
token, LSE all-gather, exp(local - global) correction, reduce-scatter of heads. Both DCP
versions run in the same threaded world on the same weights and caches; the single-device
model runs eagerly in this process. Prints step times and the ratios side by side.

    python3 benchmarks/bench_decode.py [--tp 4 --dcp 2 --context 256 --steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dcp_compile
from dcp_compile import layout
from dcp_compile.models import DemoConfig, demo_model, rope_cos_sin, rotate_half
from runtime.engine import Engine, LocalExecutor, StepShapes
from runtime.kv_cache import KVCacheSpec
from runtime.world import run_threaded

FC = torch.ops._c10d_functional


def hand_written_step(model, cfg, rank, tp, dcp, groups, input_ids, positions, table,
                      caches):
    """One decode step of the demo model on ``rank``, from the spec, eager."""
    c = model.config
    hq, d = c.num_q_heads // tp, c.head_dim
    kv_rep = tp // c.num_kv_heads
    kv_head = rank // kv_rep
    cp = rank % dcp
    kw = dict(dcp=dcp, interleave=cfg.interleave_size, block=cfg.block_size)
    B = cfg.block_size
    b = input_ids.shape[0]
    vocab_per = c.vocab_size // tp
    local_ids = input_ids - rank * vocab_per
    inside = (local_ids >= 0) & (local_ids < vocab_per)
    emb_w = model.embed_tokens.weight[rank * vocab_per:(rank + 1) * vocab_per]
    x = F.embedding(torch.where(inside, local_ids, 0), emb_w) * inside[..., None]
    x = FC.wait_tensor(FC.all_reduce(x, "sum", groups["tp"]))
    cos, sin = rope_cos_sin(positions, model.inv_freq, x.dtype)
    n = positions[:, 0].clamp(min=0)
    new_caches = []
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = F.linear(h, a.q_proj.weight[rank * hq * d:(rank + 1) * hq * d]).view(b, 1, hq, d)
        k = F.linear(h, a.k_proj.weight[kv_head * d:(kv_head + 1) * d]).view(b, 1, 1, d)
        v = F.linear(h, a.v_proj.weight[kv_head * d:(kv_head + 1) * d]).view(b, 1, 1, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        kc, vc = caches[2 * i].clone(), caches[2 * i + 1].clone()
        # 1. owner-only cache write (others -> garbage block)
        own = layout.owner(n, **kw) == cp
        ls = layout.local_slot(n, **kw)
        row = table.gather(1, (ls // B)[:, None])[:, 0] * B + ls % B
        row = torch.where(own, row, (kc.shape[0] - 1) * B)
        kc.view(-1, 1, d)[row] = k[:, 0]
        vc.view(-1, 1, d)[row] = v[:, 0]
        # 2. all-gather Q across the DCP group
        qa = FC.wait_tensor(FC.all_gather_into_tensor(q, dcp, groups["dcp"]))
        qa = qa.view(dcp, b, hq, d).permute(1, 0, 2, 3).reshape(b, dcp * hq, d)
        # 3. local attention over [0, local_filled) + the active token if owned
        filled = layout.local_filled(n, cp, **kw)
        slots = torch.arange(table.shape[1] * B)
        rows = table.clamp(min=0)[:, slots // B] * B + slots % B
        keys = torch.cat([kc.view(-1, d)[rows], k[:, 0]], 1)               # [b, L+1, d]
        vals = torch.cat([vc.view(-1, d)[rows], v[:, 0]], 1)
        valid = torch.cat([slots[None] < filled[:, None], own[:, None]], 1)
        vals = torch.where(valid[..., None], vals, 0.0)
        s = torch.einsum("bhd,bjd->bhj", qa, keys) * a.scale
        s = s.masked_fill(~valid[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)                                          # 4.
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        o = torch.einsum("bhj,bjd->bhd", p, vals)
        # 5-7. all-gather LSE, correct by exp(local - global)
        lse_all = FC.wait_tensor(FC.all_gather_into_tensor(lse, dcp, groups["dcp"]))
        glob = torch.logsumexp(lse_all.view(dcp, b, dcp * hq), 0)
        w = torch.where(torch.isfinite(lse) & torch.isfinite(glob), torch.exp(lse - glob), 0.0)
        o = o * w[..., None]
        # 8. reduce-scatter: sum over the group, each rank keeps its heads
        o = o.view(b, dcp, hq, d).permute(1, 0, 2, 3).reshape(dcp * b, hq, d).contiguous()
        o = FC.wait_tensor(FC.reduce_scatter_tensor(o, "sum", dcp, groups["dcp"]))
        out = F.linear(o.reshape(b, 1, hq * d), a.o_proj.weight[:, rank * hq * d:
                                                                   (rank + 1) * hq * d])
        x = x + FC.wait_tensor(FC.all_reduce(out, "sum", groups["tp"]))
        m = layer.mlp
        inter = c.intermediate_size // tp
        sl = slice(rank * inter, (rank + 1) * inter)
        h = layer.post_attention_layernorm(x)
        g = F.silu(F.linear(h, m.gate_proj.weight[sl])) * F.linear(h, m.up_proj.weight[sl])
        x = x + FC.wait_tensor(FC.all_reduce(F.linear(g, m.down_proj.weight[:, sl]), "sum",
                                             groups["tp"]))
        new_caches += [kc, vc]
    logits = F.linear(model.norm(x), model.lm_head.weight[rank * vocab_per:
                                                          (rank + 1) * vocab_per])
    logits = FC.wait_tensor(FC.all_gather_into_tensor(logits, tp, groups["tp"]))
    logits = logits.view(tp, b, 1, vocab_per).permute(1, 2, 0, 3).reshape(b, 1, -1)
    return logits, new_caches


def timed(fn, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] if len(times) > 4 else times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = demo_model(DemoConfig(num_layers=2))
    shapes = StepShapes.fitting(args.batch, args.context, args.context + args.steps + 1,
                                block_size=16, dcp=args.dcp)
    prog = dcp_compile.transform(model, tp=args.tp, dcp=args.dcp, mode="decode",
                                 shapes=shapes)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.context,), generator=g).tolist()
               for _ in range(args.batch)]

    def rank_main(rank):
        from runtime.world import bind_roles
        names = bind_roles(prog.topology, rank)
        loaded = prog.load(rank, names)
        ex = LocalExecutor(loaded.step_fns(), prog.cache_spec().allocate())
        eng = Engine(ex, shapes, block_size=16, dcp=args.dcp, prompt_kind="context")
        with torch.no_grad():
            logits = eng.prefill(prompts)
            tok = logits.argmax(-1).tolist()
            t_prog = timed(lambda: eng.decode(tok), args.steps)
            # Hand-written, same caches and block table layout, fixed position.
            table = eng.allocator.table(list(range(args.batch)), shapes.max_blocks)
            ids = torch.tensor(tok)[:, None]
            pos = torch.tensor(eng.lengths)[:, None]
            caches = list(ex.caches)
            t_hand = timed(lambda: hand_written_step(model, prog.config, rank, args.tp,
                                                     args.dcp, names, ids, pos, table,
                                                     caches), args.steps)
            ref_logits, _ = hand_written_step(model, prog.config, rank, args.tp, args.dcp,
                                              names, ids, pos, table, caches)
            got_logits, _ = loaded.run("decode", ids, pos, table, caches)
        return t_prog, t_hand, float((ref_logits - got_logits).abs().max())

    res = run_threaded(args.tp, rank_main, timeout=600)
    t_prog, t_hand, diff = res[0]
    spec = KVCacheSpec(2, (shapes.num_blocks - 1) * args.dcp + 1, 16,
                       model.config.num_kv_heads, model.config.head_dim)
    eng = Engine(LocalExecutor(model, spec.allocate()),
                 StepShapes(args.batch, args.context, shapes.max_blocks * args.dcp,
                            (shapes.num_blocks - 1) * args.dcp + 1), block_size=16)
    with torch.no_grad():
        tok = eng.prefill(prompts).argmax(-1).tolist()
        t_single = timed(lambda: eng.decode(tok), args.steps)
    print(f"decode step, demo model (2 layers), batch={args.batch}, context={args.context}, "
          f"tp={args.tp}, dcp={args.dcp}, {args.tp} ranks on threads of one 2-core machine")
    print(f"{'version':<28} {'ms/step':>9} {'vs hand-written':>16} {'vs single device':>17}")
    for name, t in (("transformed program", t_prog), ("hand-written eager DCP", t_hand),
                    ("single device (eager)", t_single)):
        print(f"{name:<28} {t * 1e3:>9.2f} {t / t_hand:>16.2f} {t / t_single:>17.2f}")
    print(f"max |logits(program) - logits(hand-written)| = {diff:.2e}")


if __name__ == "__main__":
    main()

"""Decode step time of transformed programs on the threaded world, side by side in one run.

Tables (all ratios come from this one run; read them with the load average printed next to
them — the machine is shared, single numbers are noisy):

  1. step time vs cache capacity at a fixed context (1x, 8x, 64x the blocks needed; the block
     table widened with it): the goal is flat (<= 1.1x), which in-place cache writes and
     live-span attention (dcp_compile.runtime.kernels.eager) give on eager backends;
  2. step time vs context length at tp=4 for dcp = 1, 2, 4;
  3. program vs a hand-written eager DCP step (written here from the spec's "Decode Compute
     Pattern", without the passes; it also writes in place and reads the live span);
  4. combine="all_gather" vs "all_to_all": step time and DCP bytes per layer;
  5. KV tokens and bytes per rank vs the single device.
Then a torch.profiler table of one rank's decode steps. ``--sections kernel`` times, on one
world and interleaved step by step, the program with the reference live-span attention body
(``where``/``cat`` copies: the kernel before runtime/kernels/live_attention.py), the program as it
loads now, and the hand-written step.

Caches are filled with random KV (no prompt step: a 16k-token prompt chunk would dominate
the run); every step decodes at the same position, which is what a step costs.

    python3 benchmarks/bench_decode.py [--contexts 1024 4096 16384 --steps 6 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import dcp_compile
from dcp_compile.runtime import layout
from dcp_compile.models.demo import DemoConfig, demo_model, rope_cos_sin, rotate_half
from dcp_compile.passes.collectives import collective_summary
from dcp_compile.runtime.serving.engine import StepShapes
from dcp_compile.runtime.serving.rank_engine import load_rank
from dcp_compile.runtime.distributed.world import run_threaded
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
import docs_section  # noqa: E402  (benchmarks/docs_section.py: --write-docs)

FC = torch.ops._c10d_functional
BLOCK = 16


def hand_written_step(model, cfg, rank, tp, dcp, groups, input_ids, positions, table,
                      caches):
    """One decode step of the demo model on ``rank``, from the spec, eager, caches written
    in place, attention over the live block-table span only."""
    c = model.config
    hq, d = c.num_q_heads // tp, c.head_dim
    kv_rep = max(1, tp // c.num_kv_heads)
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
    filled = layout.local_filled(n, cp, **kw)
    live = -(-int(filled.max()) // B)
    slots = torch.arange(live * B)
    rows = table[:, :live].clamp(min=0)[:, slots // B] * B + slots % B
    own = layout.owner(n, **kw) == cp
    ls = layout.local_slot(n, **kw)
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = F.linear(h, a.q_proj.weight[rank * hq * d:(rank + 1) * hq * d]).view(b, 1, hq, d)
        k = F.linear(h, a.k_proj.weight[kv_head * d:(kv_head + 1) * d]).view(b, 1, 1, d)
        v = F.linear(h, a.v_proj.weight[kv_head * d:(kv_head + 1) * d]).view(b, 1, 1, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        kc, vc = caches[2 * i], caches[2 * i + 1]
        # 1. owner-only cache write, in place (others -> garbage block)
        row = table.gather(1, (ls // B)[:, None])[:, 0] * B + ls % B
        row = torch.where(own, row, (kc.shape[0] - 1) * B)
        kc.view(-1, 1, d)[row] = k[:, 0]
        vc.view(-1, 1, d)[row] = v[:, 0]
        # 2. all-gather Q across the DCP group
        qa = FC.wait_tensor(FC.all_gather_into_tensor(q, dcp, groups["dcp"])) if dcp > 1 \
            else q
        qa = qa.view(dcp, b, hq, d).permute(1, 0, 2, 3).reshape(b, dcp * hq, d)
        # 3. local attention over [0, local_filled) + the active token if owned
        keys = torch.cat([kc.view(-1, d)[rows], k[:, 0]], 1)               # [b, L+1, d]
        vals = torch.cat([vc.view(-1, d)[rows], v[:, 0]], 1)
        valid = torch.cat([slots[None] < filled[:, None], own[:, None]], 1)
        vals = torch.where(valid[..., None], vals, 0.0)
        s = torch.einsum("bhd,bjd->bhj", qa, keys) * a.scale
        s = s.masked_fill(~valid[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)                                          # 4.
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        o = torch.einsum("bhj,bjd->bhd", p, vals)
        if dcp > 1:
            # 5-7. all-gather LSE, correct by exp(local - global)
            lse_all = FC.wait_tensor(FC.all_gather_into_tensor(lse, dcp, groups["dcp"]))
            glob = torch.logsumexp(lse_all.view(dcp, b, dcp * hq), 0)
            w = torch.where(torch.isfinite(lse) & torch.isfinite(glob), torch.exp(lse - glob),
                            0.0)
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
    logits = F.linear(model.norm(x), model.lm_head.weight[rank * vocab_per:
                                                          (rank + 1) * vocab_per])
    logits = FC.wait_tensor(FC.all_gather_into_tensor(logits, tp, groups["tp"]))
    logits = logits.view(tp, b, 1, vocab_per).permute(1, 2, 0, 3).reshape(b, 1, -1)
    return logits, caches


def reference_live_attention(q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache,
                             block_table, prior_len, *rest, **kwargs):
    """The eager attention before runtime/kernels/live_attention.py: the static op's reference body
    (cat of prior and current keys, where-zeroed values) on the live block-table span."""
    from dcp_compile.runtime.kernels.live_attention import live_entries
    from dcp_compile.runtime.kernels.ops import _partial_attention_impl
    entries = live_entries(prior_len, key_cache.shape[1], block_table.shape[1])
    return _partial_attention_impl(q, q_pos, k_cur, v_cur, k_pos, key_cache, value_cache,
                                   block_table[:, :entries], prior_len, *rest, **kwargs)


def with_reference_kernel(loaded, kind="decode"):
    """``loaded`` with its live-span attention nodes running reference_live_attention."""
    gm = loaded.graphs[kind]
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == torch.ops.dcp.partial_attention_live.default:
            n.target = reference_live_attention
    gm.recompile()
    return loaded


def interleaved(fns: dict, steps: int) -> dict:
    """Median (wall, CPU) seconds of each of ``fns``, timed in turn step by step."""
    for fn in fns.values():
        fn()                                                    # warm-up
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(steps):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.thread_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in fns}


def timed(fn, steps):
    """Median (wall seconds, this thread's CPU seconds) per call. On a shared machine the
    CPU time is the steadier number: it leaves out waiting for other ranks and processes."""
    fn()                                                        # warm-up
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def shapes_for(batch, context, dcp, capacity=1):
    """Block table and cache sized ``capacity`` times what ``context`` + 1 tokens need."""
    need = -(-(context + 1) // (BLOCK * dcp))
    return StepShapes(batch=batch, context_len=BLOCK, max_blocks=need * capacity,
                      num_blocks=batch * need * capacity + 1)


def run_steps(prog, model, context, steps, *, hand=False, profile=None, compile="eager"):
    """Median decode step time (rank 0) of ``prog`` (and of the hand-written step);
    ``compile="inductor"``: each rank's graph compiled by Inductor (timed after its first,
    compiling, step)."""
    c = prog.config

    def rank_main(rank):
        from dcp_compile.runtime.distributed.world import bind_roles
        names = bind_roles(prog.topology, rank)
        loaded = load_rank(prog, rank, names, compile=compile)
        caches, table, ids, pos = random_decode_inputs(prog, model, context, rank)
        out = {}
        with torch.no_grad():
            out["program"] = timed(lambda: loaded.run("decode", ids, pos, table, caches), steps)
            if hand:
                hw = lambda: hand_written_step(model, c, rank, c.tp, c.dcp, names, ids, pos,
                                               table, caches)
                out["hand"] = timed(hw, steps)
                out["diff"] = float((hw()[0] - loaded.run("decode", ids, pos, table,
                                                          caches)[0]).abs().max())
            if profile and rank == 0:
                from torch.profiler import ProfilerActivity, profile as prof
                with prof(activities=[ProfilerActivity.CPU]) as p:
                    for _ in range(steps):
                        loaded.run("decode", ids, pos, table, caches)
                out["profile"] = p.key_averages().table(sort_by="self_cpu_time_total",
                                                        row_limit=profile)
            else:
                for _ in range(steps if profile else 0):   # keep the collectives matched
                    loaded.run("decode", ids, pos, table, caches)
        return out

    return run_threaded(c.tp, rank_main, timeout=3600)[0]


# Fraction of a collective's input a rank sends to the other W - 1 ranks of its group.
SENT_FRACTION = {"all_gather_into_tensor": lambda w: w - 1,
                 "reduce_scatter_tensor": lambda w: (w - 1) / w,
                 "all_to_all_single": lambda w: (w - 1) / w}


def dcp_bytes_per_layer(prog) -> int:
    """Bytes one rank sends to the others of its DCP group in one layer's decode step."""
    w = prog.config.dcp
    return int(sum(x["bytes_in"] * SENT_FRACTION[x["op"]](w)
                   for x in collective_summary(prog.graphs["decode"])
                   if x["role"] == "dcp" and x["layer"] == 0))


def ms(t) -> str:
    return f"{t[0] * 1e3:.2f}/{t[1] * 1e3:.2f}"


def ratio(a, b) -> str:
    return f"{a[0] / b[0]:.2f}/{a[1] / b[1]:.2f}"


def load() -> str:
    return "load %.1f %.1f %.1f" % os.getloadavg()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--capacity-context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile-rows", type=int, default=15)
    ap.add_argument("--sections", default="capacity,context,kv,profile,inductor,kernel",
                    help="comma-separated subset of capacity,context,kv,profile,inductor,"
                         "kernel")
    docs_section.add_argument(ap)
    args = ap.parse_args()
    with docs_section.recorded("bench_decode kernel" if args.sections == "kernel" else "bench_decode", args.write_docs):
        torch.set_num_threads(1)
        # 16 q heads, head_dim 64 (hidden 1024). One KV head: tp=4 with dcp in {1, 2, 4} needs
        # tp > KV heads (decode DCP replicates a KV head over its replica set); each rank then
        # holds one KV head, as it would with 4 KV heads at tp=4, dcp=1.
        cfg = DemoConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=1, head_dim=64,
                         intermediate_size=2816, num_layers=args.layers, vocab_size=1024)
        model = demo_model(cfg)
        tp, b = args.tp, args.batch
        print(f"decode step, demo model hidden={cfg.hidden_size}, {cfg.num_q_heads} q heads, "
              f"{cfg.num_kv_heads} KV head, head_dim={cfg.head_dim}, {cfg.num_layers} layers, "
              f"batch={b}, fp32, {tp} ranks on threads of one shared {os.cpu_count()}-core "
              f"machine ({load()} at start); median of {args.steps} steps")

        def transform(dcp, shapes, combine="all_gather"):
            return dcp_compile.transform(model, tp=tp, dcp=dcp, shapes=shapes, combine=combine)

        sections = set(args.sections.split(","))
        if "capacity" in sections:
            capacity_table(args, model, transform, b, tp)
        if "kernel" in sections:
            kernel_table(args, model, transform, b, tp)
        if sections & {"context", "kv", "profile", "inductor"}:
            progs = context_tables(args, model, transform, b, tp, "context" in sections)
        if "kv" in sections:
            kv_table(args, cfg, progs)
        if "inductor" in sections:
            inductor_table(args, model, progs[2])
        if "profile" in sections:
            longest = max(args.contexts)
            print(f"\nprofile: rank 0 of tp={tp}, dcp=2, context={longest}, {args.steps} steps")
            print(run_steps(progs[2], model, longest, args.steps,
                            profile=args.profile_rows)["profile"])


def inductor_table(args, model, prog):
    """5: the same program run eagerly and compiled by Inductor, side by side."""
    print(f"\n5. eager vs Inductor (compile='inductor'), tp={prog.config.tp}, dcp=2: wall ms / "
          f"rank-0 CPU ms (Inductor timed after its compiling first step)")
    print(f"{'context':>8} {'eager':>15} {'inductor':>15} {'ind/eager':>11}  load")
    for context in args.contexts:
        eager = run_steps(prog, model, context, args.steps)["program"]
        t = time.perf_counter()
        inductor = run_steps(prog, model, context, args.steps, compile="inductor")["program"]
        print(f"{context:>8} {ms(eager):>15} {ms(inductor):>15} {ratio(inductor, eager):>11}  "
              f"{load()}  (inductor run incl. compile {time.perf_counter() - t:.0f} s)")


def kernel_table(args, model, transform, b, tp):
    """6: before/after the eager attention kernel, and the hand-written step, interleaved."""
    print(f"\n6. eager attention kernel, tp={tp}: reference body (before) / live_attention "
          f"(now) / hand-written, interleaved step by step; wall ms / rank-0 CPU ms")
    print(f"{'dcp':>3} {'context':>8} {'before':>15} {'now':>15} {'hand':>15} "
          f"{'before/hand':>11} {'now/hand':>11}  load")
    longest = max(args.contexts)
    for dcp in (1, 2, 4):
        prog = transform(dcp, shapes_for(b, longest, dcp))
        for context in args.contexts:
            r = run_threaded(tp, lambda rank: _kernel_rank(prog, model, context, args.steps,
                                                            rank), timeout=3600)[0]
            print(f"{dcp:>3} {context:>8} {ms(r['before']):>15} {ms(r['now']):>15} "
                  f"{ms(r['hand']):>15} {ratio(r['before'], r['hand']):>11} "
                  f"{ratio(r['now'], r['hand']):>11}  {load()}")


def random_decode_inputs(prog, model, context, rank):
    """One rank's decode-step inputs at ``context``: caches of random KV, a full block table,
    random ids (seeded by rank)."""
    b, max_blocks = prog.shapes.batch, prog.shapes.max_blocks
    g = torch.Generator().manual_seed(rank)
    caches = [torch.randn(t.shape, generator=g, dtype=t.dtype)
              for t in prog.cache_spec().allocate()]
    table = torch.arange(b * max_blocks).view(b, max_blocks)
    ids = torch.randint(0, model.config.vocab_size, (b, 1), generator=g)
    return caches, table, ids, torch.full((b, 1), context)


def _kernel_rank(prog, model, context, steps, rank):
    from dcp_compile.runtime.distributed.world import bind_roles
    c = prog.config
    names = bind_roles(prog.topology, rank)
    now = load_rank(prog, rank, names)
    before = with_reference_kernel(load_rank(prog, rank, names))
    caches, table, ids, pos = random_decode_inputs(prog, model, context, rank)
    with torch.no_grad():
        return interleaved({
            "before": lambda: before.run("decode", ids, pos, table, caches),
            "now": lambda: now.run("decode", ids, pos, table, caches),
            "hand": lambda: hand_written_step(model, c, rank, c.tp, c.dcp, names, ids, pos,
                                              table, caches)}, steps)


def capacity_table(args, model, transform, b, tp):
    ctx = args.capacity_context
    print(f"\n1. step time vs cache capacity (tp={tp}, dcp=2, context={ctx})")
    print(f"{'capacity':>9} {'blocks/rank':>12} {'wall ms':>9} {'vs 1x':>7} {'cpu ms':>8} "
          f"{'vs 1x':>7}  load")
    base = None
    for cap in (1, 8, 64):
        prog = transform(2, shapes_for(b, ctx, 2, cap))
        t = run_steps(prog, model, ctx, args.steps)["program"]
        base = base or t
        print(f"{cap:>8}x {prog.shapes.num_blocks:>12} {t[0] * 1e3:>9.2f} {t[0] / base[0]:>7.2f} "
              f"{t[1] * 1e3:>8.2f} {t[1] / base[1]:>7.2f}  {load()}")


def context_tables(args, model, transform, b, tp, run):
    """2-4: context sweep per dcp, program vs hand-written, combines (``run=False``: only
    build the programs)."""
    longest = max(args.contexts)
    progs = {dcp: transform(dcp, shapes_for(b, longest, dcp)) for dcp in (1, 2, 4)}
    if not run:
        return progs
    print(f"\n2-4. step time vs context at tp={tp}: program (all_gather combine), hand-written, "
          f"program with the all_to_all combine; wall ms / rank-0 CPU ms")
    print(f"{'dcp':>3} {'context':>8} {'program':>15} {'hand':>15} {'prog/hand':>11} "
          f"{'all_to_all':>15} {'a2a/ag':>11} {'max|diff|':>9}  load")
    for dcp in (1, 2, 4):
        a2a = transform(dcp, shapes_for(b, longest, dcp), "all_to_all") if dcp > 1 else None
        for context in args.contexts:
            r = run_steps(progs[dcp], model, context, args.steps, hand=True)
            t_a2a = run_steps(a2a, model, context, args.steps)["program"] if a2a else None
            a2a_cols = (f"{ms(t_a2a):>15} {ratio(t_a2a, r['program']):>11}" if a2a
                        else f"{'-':>15} {'-':>11}")
            print(f"{dcp:>3} {context:>8} {ms(r['program']):>15} {ms(r['hand']):>15} "
                  f"{ratio(r['program'], r['hand']):>11} {a2a_cols} {r['diff']:>9.1e}  {load()}")
        if a2a:
            print(f"    dcp={dcp} collectives per layer: all_gather "
                  f"{progs[dcp].collectives_per_layer('decode')} ({dcp_bytes_per_layer(progs[dcp])}"
                  f" B sent/rank/layer over dcp), all_to_all {a2a.collectives_per_layer('decode')} "
                  f"({dcp_bytes_per_layer(a2a)} B sent)")
    return progs


def kv_table(args, cfg, progs):
    longest = max(args.contexts)
    print(f"\n5. KV tokens and bytes per rank at context {longest} (per row; fp32, "
          f"{cfg.num_layers} layers, K and V)")
    per_token = 2 * cfg.num_layers * cfg.head_dim * 4
    single = longest * cfg.num_kv_heads * per_token
    for dcp in (1, 2, 4):
        kw = progs[dcp].config.layout_kwargs()
        toks = [int(layout.local_filled(torch.tensor(longest), r, **kw)) for r in range(dcp)]
        kv = progs[dcp].config.kv_heads_per_rank
        print(f"  dcp={dcp}: tokens per rank {toks} (context/dcp = {longest / dcp:g}), "
              f"bytes per rank {toks[0] * kv * per_token} + one garbage block "
              f"{BLOCK * kv * per_token // (2 * cfg.num_layers)} B per cache = "
              f"{toks[0] * kv * per_token / single:.3f} of the single device's {single} B")


if __name__ == "__main__":
    main()

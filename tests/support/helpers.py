"""Shared test helpers: seeded prompts, the model's own greedy reference and the one
numerical comparison helper."""

from __future__ import annotations

import torch


def seeded_weights(model, seed: int = 0):
    """``model`` with seeded weights large enough that greedy tokens are not near-ties;
    norms and biases random too, so a mis-sharded one could not go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # A norm's own parameter (``input_layernorm.weight``, ``layer_norm1.0.weight``),
            # not every parameter under a module whose name says norm (DBRX's attention
            # lives in ``norm_attn_norm.attn``).
            owner, leaf = (["", *[c for c in name.split(".") if not c.isdigit()]])[-2:]
            if "norm" in owner or "norm" in leaf:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


def prompts_of(lengths, *, vocab=256, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, *, atol: float,
                        rtol: float = 0.0, what: str = "output") -> float:
    """Assert closeness; on failure name the max error and the first index that differs."""
    actual, expected = actual.detach().float(), expected.detach().float()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values at " \
        f"{(~torch.isfinite(actual)).nonzero()[0].tolist()}"
    err = (actual - expected).abs()
    bad = err > atol + rtol * expected.abs()
    if bad.any():
        first = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: max abs error {err.max():.3e} > atol {atol:g}; first "
                             f"differing index {first}: {actual[tuple(first)]:.6g} vs "
                             f"{expected[tuple(first)]:.6g}")
    return float(err.max())


def assert_runs_match(runs, ref_tokens, ref_logits, *, atol: float, lengths=None) -> float:
    """Every rank's run of a program decodes the reference's greedy tokens with its
    per-step logits (``ref_logits[seq][step]``) within ``atol``; returns the worst error.
    ``lengths`` (the prompts') name each sequence's length in a failure."""
    worst = 0.0
    for run in runs:
        assert run.result.tokens == ref_tokens, f"rank {run.rank}"
        for t, got in enumerate(run.result.logits):
            for b in range(len(ref_tokens)):
                length = f" (len={lengths[b]})" if lengths else ""
                worst = max(worst, assert_close_report(
                    got[b], ref_logits[b][t], atol=atol,
                    what=f"rank {run.rank} step {t} seq {b}{length}"))
    return worst


def single_device_reference(lengths, steps, *, seed=0):
    """Greedy generation of the demo model on one device, with the decode workers' prompts
    and shapes (dcp_compile.workers.decode): what every multi-process decode test compares to."""
    from dcp_compile.models.demo import demo_model
    from dcp_compile.workers.decode import prompt_tokens, shapes_for
    from dcp_compile.runtime.serving.engine import Engine, LocalExecutor
    from dcp_compile.runtime.serving.kv_cache import KVCacheSpec

    model = demo_model()
    shapes = shapes_for(lengths, steps, 1)
    c = model.config
    spec = KVCacheSpec(c.num_layers, shapes.num_blocks, 16, c.num_kv_heads, c.head_dim)
    with torch.no_grad():
        return Engine(LocalExecutor(model, spec.allocate()), shapes,
                      block_size=16).generate(prompt_tokens(lengths, seed), steps)


def full_forward_reference(model, prompts, steps):
    """Greedy tokens and per-step logits from the model's own forward, no cache (``model``
    returns logits, or an output with ``.logits``)."""
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(steps):
                seq.append(int(_logits(model, seq)[-1].argmax()))
            tokens.append(seq[len(p):])
            logits.append(_logits(model, seq[:-1])[len(p) - 1:])
    return tokens, logits


def _logits(model, seq):
    out = model(torch.tensor([seq]))
    return (out if isinstance(out, torch.Tensor) else out.logits)[0]



def assert_live_kernel_matches_reference(**options) -> None:
    """The eager kernel (``live_partial_attention``) and the reference
    (``_partial_attention_impl``) agree, output and LSE, on one fixed decode batch (two rows
    over a prior of 9 and 5 tokens, rank 1 of dcp 2) with the kernel ``options`` (ALiBi
    slopes, an attention chunk)."""
    from dcp_compile.runtime.kernels.live_attention import live_partial_attention
    from dcp_compile.runtime.kernels.ops import _partial_attention_impl
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, d, block, nb = 2, 4, 2, 8, 4, 9
    q = torch.randn(b, 1, hq, d, generator=g)
    kc, vc = (torch.randn(nb, block, hkv, d, generator=g) for _ in range(2))
    k_cur, v_cur = (torch.randn(b, 1, hkv, d, generator=g) for _ in range(2))
    table = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1]])
    prior, q_pos, rank = torch.tensor([9, 5]), torch.tensor([[18], [11]]), torch.tensor(1)
    args = (q, q_pos, k_cur, v_cur, q_pos, kc, vc, table, prior, rank, 2, 2, 0.35)
    ref = _partial_attention_impl(*args, **options)
    live = live_partial_attention(*args, **options)
    for a, e, what in zip(live, ref, ("out", "lse")):
        assert_close_report(a, e, atol=1e-5, what=what)

"""What a decode step costs, structurally (no timing): eager kernels swapped in at load, no
cache copied, attention reading only the live span, collectives per layer per combine, the
all-to-all combine lowering to StableHLO, and bad combine values refused."""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dcp_compile
from dcp_compile.runtime.config import COMBINE_DTYPES, COMBINES
from dcp_compile.runtime.errors import DCPConfigError, DCPTransformError
from dcp_compile.runtime.kernels.op_defs import op_of
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.verify import run_reference
from dcp_compile.runtime.kernels.eager import specialize_for_eager
from dcp_compile.runtime.serving.engine import Engine, LocalExecutor, StepShapes

from helpers import assert_close_report, prompts_of

dcp_ops = torch.ops.dcp
MQA = DemoConfig(num_layers=2, num_kv_heads=1, seed=1)          # tp=2 > 1 KV head


@functools.lru_cache(maxsize=None)
def program(combine="all_gather", capacity=1, tp=2, dcp=2):
    """tp=2/dcp=2 program whose cache and block table hold ``capacity`` x what 40 tokens
    need."""
    need = -(-40 // (16 * dcp))
    shapes = StepShapes(batch=2, context_len=40, max_blocks=need * capacity,
                        num_blocks=2 * need * capacity + 1)
    model = demo_model(MQA)
    return model, dcp_compile.transform(model, tp=tp, dcp=dcp, shapes=shapes, combine=combine)


def _fake_names(prog):
    return {role: f"group_{role}" for role in prog.topology.groups}


# ------------------------------------------------------------------------------------------
# Eager kernels at load
# ------------------------------------------------------------------------------------------


def test_loaded_graphs_write_in_place_and_read_the_live_span():
    _, prog = program()
    loaded = prog.load(0, _fake_names(prog))
    layers = prog.num_layers
    for kind, gm in loaded.graphs.items():
        called = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        # Every dcp op is called as its Python function (no dispatcher per call).
        assert not [t for t in called if getattr(t, "namespace", None) == "dcp"], called
        targets = [op_of(t) for t in called]
        assert dcp_ops.cache_write.default not in targets
        assert dcp_ops.partial_attention.default not in targets
        assert targets.count(dcp_ops.cache_write_.default) == layers
        assert targets.count(dcp_ops.partial_attention_live.default) == layers
        swapped = loaded.eager_kernels[kind]
        assert (swapped["cache_write"], swapped["partial_attention"]) == (layers, layers)
        # Layout metadata of the step's inputs: computed once, not once per layer.
        assert targets.count(dcp_ops.slot_mapping.default) == 1
        # The step returns its cache inputs themselves, and only the in-place write and the
        # attention touch them: nothing else can copy a cache.
        caches = [n for n in gm.graph.nodes if n.op == "placeholder"
                  and n.name.startswith("kv_caches")]
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        assert list(out[1:]) == caches
        for c in caches:
            assert {op_of(u.target) for u in c.users if u.op == "call_function"} == {
                dcp_ops.cache_write_.default, dcp_ops.partial_attention_live.default}
    # The program itself stays functional (export, StableHLO lowering and its aliasing).
    targets = [n.target for n in prog.graphs["decode"].graph.nodes]
    assert targets.count(dcp_ops.cache_write.default) == layers
    assert dcp_ops.cache_write_.default not in targets


def test_in_place_rewrite_refuses_a_cache_read_outside_its_write():
    g = torch.fx.Graph()
    kc, vc, k, slots = (g.placeholder(n) for n in ("kc", "vc", "k", "slots"))
    write = g.call_function(dcp_ops.cache_write.default, (kc, vc, k, k, slots))
    kc2 = g.call_function(operator.getitem, (write, 0))
    old = g.call_function(torch.ops.aten.sum.default, (kc,))   # reads the cache as it was
    g.output((kc2, old))
    with pytest.raises(DCPTransformError, match=r"cannot write the KV cache in place at node "
                                                r"cache_write_default: its cache operand kc "
                                                r"is used by \[.sum_default.\]"):
        specialize_for_eager(g)


def _peak_op_allocation(fn) -> int:
    """Largest allocation made by any single op while ``fn`` runs (bytes)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn()
    return max([e.self_cpu_memory_usage for e in p.events()] + [0])


def test_eager_kernels_allocate_nothing_proportional_to_the_cache():
    """The functional ops copy the cache / gather the full table span (the positive control);
    their eager kernels allocate only what the live context needs."""
    blocks, block, d = 1025, 16, 8
    kc, vc = torch.randn(blocks, block, 1, d), torch.randn(blocks, block, 1, d)
    cache_bytes = kc.numel() * 4
    k = torch.randn(2, 1, 1, d)
    slots = torch.tensor([[5], [40]])
    assert _peak_op_allocation(lambda: dcp_ops.cache_write(kc, vc, k, k, slots)) >= cache_bytes
    assert _peak_op_allocation(lambda: dcp_ops.cache_write_(kc, vc, k, k, slots)) < 1024

    table = torch.arange(2 * 512).view(2, 512)          # wide table, 2 blocks live per row
    args = (torch.randn(2, 1, 4, d), torch.tensor([[20], [30]]), k, k,
            torch.tensor([[20], [30]]), kc, vc, table, torch.tensor([20, 30]),
            torch.tensor(0), 1, 16, 0.5)
    live_bytes = 2 * 2 * block * d * 4                  # 2 rows x 2 blocks of keys
    assert _peak_op_allocation(lambda: dcp_ops.partial_attention(*args)) >= cache_bytes / 2
    assert _peak_op_allocation(lambda: dcp_ops.partial_attention_live(*args)) <= 4 * live_bytes
    for a, b in zip(dcp_ops.partial_attention(*args), dcp_ops.partial_attention_live(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("prior", [[0, 0], [1, 0], [16, 17], [31, 32], [47, 3]])
def test_live_span_attention_equals_the_static_span(prior):
    """Empty priors, a block edge, and a mixed batch: same outputs and LSEs, with -1 table
    entries and stale data beyond the live span."""
    g = torch.Generator().manual_seed(sum(prior))
    kc, vc = (torch.randn(9, 16, 2, 8, generator=g) for _ in range(2))
    table = torch.tensor([[3, 1, 5, -1], [0, 2, 6, 7]])
    pos = torch.tensor(prior)[:, None]
    k = torch.randn(2, 1, 2, 8, generator=g)
    args = (torch.randn(2, 1, 4, 8, generator=g), pos, k, k, pos, kc, vc, table,
            torch.tensor(prior), torch.tensor(0), 1, 16, 0.35)
    for a, b in zip(dcp_ops.partial_attention(*args), dcp_ops.partial_attention_live(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_step_at_64x_capacity_allocates_no_cache_and_matches_the_single_device():
    """tp=2/dcp=2 with caches and block tables 64x what the context needs: every rank's decode
    steps return its cache tensors themselves, no op allocates a cache's worth (or the block
    table span's: rank 0, profiled), and the logits equal the single-device model's."""
    from dcp_compile.runtime.distributed.world import bind_roles, run_threaded
    model, prog = program(capacity=64)
    prompts = prompts_of([1, 33], seed=4)
    ref, _ = run_reference(model, prog, prompts, 3)
    cache_bytes = prog.cache_spec().allocate()[0].numel() * 4

    def rank_main(rank):
        loaded = prog.load(rank, bind_roles(prog.topology, rank))
        caches = prog.cache_spec().allocate()
        ex = LocalExecutor(loaded.step_fns(), list(caches))
        eng = Engine(ex, prog.shapes, block_size=16, dcp=2, prompt_kind="context")
        more = {}
        with torch.no_grad():
            result = eng.generate(prompts, 2)                   # prompt step + one decode
            step = lambda: more.setdefault(                     # one more decode
                "r", eng.continue_generate(result.logits[-1], 2))
            # The profiler is per process: rank 0 records (both ranks run the same graph).
            peak = _peak_op_allocation(step) if rank == 0 else step() and 0
        same = all(a is b for a, b in zip(ex.caches, caches))
        return result.logits + more["r"].logits[1:], peak, same

    for logits, peak, same in run_threaded(2, rank_main):
        assert len(logits) == 3 and same, "a step returned new cache tensors"
        assert peak < cache_bytes / 8, f"an op allocated {peak} B (cache: {cache_bytes} B)"
        for t, (got, exp) in enumerate(zip(logits, ref.logits)):
            assert_close_report(got, exp, atol=1e-4, what=f"step {t}")


# ------------------------------------------------------------------------------------------
# Combine: collectives per layer, lowering, bad values
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("combine,expected", [
    ("all_gather", {"all_gather_into_tensor@dcp": 2.0, "reduce_scatter_tensor@dcp": 1.0,
                    "all_reduce@tp": 2.0}),
    ("all_to_all", {"all_gather_into_tensor@dcp": 1.0, "all_to_all_single@dcp": 1.0,
                    "all_reduce@tp": 2.0})])
def test_collectives_per_layer_per_combine(combine, expected):
    _, prog = program(combine)
    assert prog.collectives_per_layer("decode") == expected
    assert prog.config.combine == combine
    # The context step has no DCP combine.
    assert not any(k.endswith("@dcp") for k in prog.collectives_per_layer("context"))


def test_all_to_all_decode_lowers_without_a_channel_and_keeps_cache_aliasing():
    pytest.importorskip("torch_mlir")
    from dcp_compile.lowering import lower
    _, prog = program("all_to_all")
    m = lower(prog, steps=["decode"])["decode"]
    kinds = [(c.kind, c.role, c.channel_handle) for c in m.collectives]
    assert ("all_to_all", "dcp", None) in kinds and ("all_gather", "dcp", 2) in kinds
    assert not [k for k in kinds if k[0] == "reduce_scatter"]
    for k in range(2 * prog.num_layers):
        assert f'dcp.name = "kv_caches_{k}", tf.aliasing_output = {k + 1} : i32' in m.text


@pytest.mark.parametrize("kwargs,allowed", [
    (dict(combine="ring"), COMBINES), (dict(combine_dtype="bf16"), COMBINE_DTYPES),
    (dict(combine=None), COMBINES)])
def test_unknown_combine_values_are_refused_with_the_allowed_values(kwargs, allowed):
    model = demo_model(MQA)
    with pytest.raises(DCPConfigError) as e:
        dcp_compile.transform(model, tp=2, dcp=2, **kwargs)
    assert str(allowed) in str(e.value)


def test_combine_is_a_decode_option():
    with pytest.raises(DCPConfigError, match="choose the decode combine only"):
        dcp_compile.DCPConfig(tp=4, dcp=2, mode="prefill", combine="all_to_all")


# The all-to-all decode program, lowered, on interpreter replicas against the single-device
# model: tests/lowering/test_lowering_interpreter.py (world decode-demo-all_to_all).


def test_live_span_kernel_takes_every_argument_of_the_op_it_replaces():
    # The eager swap keeps the node's arguments: the live kernel must accept each of them
    # (a window / softcap the static op takes and the live one did not broke Gemma-style
    # models on the eager backends).
    static = torch.ops.dcp.partial_attention.default._schema.arguments
    live = torch.ops.dcp.partial_attention_live.default._schema.arguments
    assert [(a.name, str(a.type)) for a in static] == \
        [(a.name, str(a.type)) for a in live]

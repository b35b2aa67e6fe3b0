"""The published-numbers table (benchmarks/bench_plan.py --published, docs/planner.md
"Against published DCP numbers"): each figure's ratio is the source's own numbers, and the
prediction set next to it is the planner's own pricing of the two layouts' programs (the
same step times ``planner.plan`` ranks by), with the KV capacity capping a throughput
figure's running batch. The full table compiles 61-layer models (minutes each); here the
demo model stands in for them, compiled at tp4 with dcp 1 and 2."""

from __future__ import annotations

import re
import sys
from dataclasses import replace

import pytest

from dcp_compile import hardware, planner
from dcp_compile.models.demo import DemoConfig, demo_model
from suite_path import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_plan  # noqa: E402

CONTEXT, BATCH, RANKS = 4096, 4, 4


def _model():
    return demo_model(DemoConfig(num_layers=1, num_q_heads=4, intermediate_size=64))


@pytest.fixture(scope="module")
def demo_breakdowns():
    """{(dcp, batch): {context: Breakdown}} of the demo model at tp4, dcp 1 and 2, as
    bench_plan.cached_breakdowns returns them for a real model."""
    model = _model()
    out = {}
    for dcp in (1, 2):
        layout = planner.Layout(RANKS, dcp, False, "all_gather", 16, 16)
        sink = planner.Plan(model="demo", ranks=RANKS, context_len=CONTEXT, batch=BATCH,
                            hardware=hardware.PROFILES["h200"])
        program = planner._compile(model, layout, CONTEXT, BATCH, sink)
        out[(dcp, BATCH)] = {CONTEXT: planner.breakdown(program, CONTEXT)}
    return out


def _figure(metric, hw="h200", concurrency=None, fp8=False):
    # the demo model allows dcp <= tp / num_kv_heads = 2 at tp4
    return bench_plan.Figure("test", "https://example.invalid", "demo", "demo", hw,
                             "tp4 vs tp4 dcp2", CONTEXT, (BATCH,), metric, 1.0,
                             fp8_weights=fp8, concurrency=concurrency, dcp=2)


@pytest.fixture(autouse=True)
def demo_ranks(monkeypatch):
    monkeypatch.setitem(bench_plan.PUBLISHED_RANKS, "demo", RANKS)


def _planner_steps(hw):
    plan = planner.plan(_model(), ranks=RANKS, dcps=(1, 2), context_len=CONTEXT, batch=BATCH,
                        hardware=hw, combines=("all_gather",), interleave_sizes=(16,))
    return {c.layout.dcp: c.prediction.step_seconds for c in plan.ranked}


def test_tpot_ratio_is_the_planners_own_step_ratio(demo_breakdowns):
    ratio, caps, unpriced, _, _ = bench_plan.published_prediction(_figure("TPOT"), BATCH,
                                                                demo_breakdowns)
    steps = _planner_steps("h200")
    assert ratio == pytest.approx(steps[2] / steps[1], rel=1e-9)
    assert ratio < 1                 # at 4096 tokens the KV read dominates: dcp2 halves it
    assert "collective latency" in unpriced
    assert caps[0] * 2 <= caps[1] <= caps[0] * 2 + 1   # half the KV a rank: twice the seqs


def test_throughput_ratio_is_capped_by_kv_capacity(demo_breakdowns):
    tpot, _, _, _, _ = bench_plan.published_prediction(_figure("TPOT"), BATCH, demo_breakdowns)
    free, _, _, _, bound = bench_plan.published_prediction(
        _figure("throughput", concurrency=BATCH), BATCH, demo_breakdowns)
    assert bound == ""
    assert free == pytest.approx(1 / tpot)       # no capacity limit: throughput = 1 / TPOT
    # memory for the weights and exactly 2 sequences of tp's KV: tp runs 2 of the 4
    # sequences, dcp2 (half the KV per rank) runs all 4
    b1 = demo_breakdowns[(1, BATCH)][CONTEXT]
    seq = b1.kv_bytes / BATCH
    small = hardware.with_overrides(hardware.PROFILES["h200"],
                                    memory_bytes=b1.weight_bytes + 2 * seq + 1)
    capped, caps, _, steps, bound = bench_plan.published_prediction(
        _figure("throughput", hw=small, concurrency=BATCH), BATCH, demo_breakdowns)
    assert caps == (2, 4)
    assert capped == pytest.approx(2 / tpot)
    assert steps[1] / steps[0] == pytest.approx(tpot)
    assert bound == "<="             # tp's step is priced at 4 sequences, it runs 2


def test_fp8_weights_what_if_halves_the_weight_bytes(demo_breakdowns):
    b = demo_breakdowns[(1, BATCH)][CONTEXT]
    h = bench_plan._with_fp8_weights(b)
    assert h.weight_bytes_read * 2 in (b.weight_bytes_read, b.weight_bytes_read - 1)
    assert h.kv_bytes == b.kv_bytes                       # the KV stays bf16
    hw = hardware.PROFILES["h200"]
    assert planner.predict(h, hw, RANKS).seconds["weights"] == pytest.approx(
        planner.predict(b, hw, RANKS).seconds["weights"] / 2, rel=1e-6)


_NUMBERS = re.compile(r"(\d+(?:\.\d+)?) ms \((?:tp8|TP8)\) vs (\d+(?:\.\d+)?) ms")


def test_each_figure_ratio_is_its_sources_numbers():
    for f in bench_plan.FIGURES:
        assert f.url.startswith("https://github.com/"), f.source
        assert f.hardware in hardware.PROFILES, f.source
        assert f.dcp == bench_plan.PUBLISHED_RANKS[f.model], f.source   # tp8 vs tp8 dcp8
        tpot = _NUMBERS.search(f.setup)
        if f.metric == "TPOT":
            tp, dcp = map(float, tpot.groups())
            assert f.published == pytest.approx(dcp / tp, abs=5e-4), f.source
        elif "output tok/s" in f.setup and " vs " in f.setup:
            dcp, tp = map(float, re.search(r"output tok/s (\d+\.\d+) \(\w.*?\) vs "
                                           r"(\d+\.\d+)", f.setup).groups())
            assert f.published == pytest.approx(dcp / tp, abs=5e-3), f.source
        assert f.context in bench_plan.PUBLISHED_CONTEXTS, f.source


def test_new_vendor_profiles_cite_a_page_for_every_number():
    for name in ("mi355x", "h20"):
        prof = hardware.PROFILES[name]
        for f in ("memory_bytes", "memory_bandwidth", "link_bandwidth", "peak_flops"):
            value, source = getattr(prof, f), prof.sources[f]
            assert ("https://" in source) if value is not None else \
                source.startswith("not found"), (name, f)
    # a missing link bandwidth is named, not priced as free
    b = replace(planner.Breakdown(0, 0, 0, 0, 10**6, 4, {}, 0, 0), weight_bytes_read=10**9)
    p = planner.predict(b, hardware.PROFILES["mi355x"], 8)
    assert "collective bandwidth" in p.unpriced and "flops" in p.unpriced

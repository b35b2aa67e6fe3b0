"""The planner (dcp_compile/planner.py): layouts enumerated are legal ones and refusals carry
their rule; the breakdown's sizes are the program's own; the ranking moves the obvious way.

The planner never changes a program, so there is no numerical comparison against a model
here: what can be wrong is a size it reads, and each is checked against the program's own
account (state_dict_for, collectives_per_layer, the layout formulas)."""

from __future__ import annotations

import json

import pytest
import torch

import dcp_compile
from dcp_compile import hardware, planner
from dcp_compile.models.demo import demo_model
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.names import RANK_INPUT
from dcp_compile.runtime.serving.engine import StepShapes

H200 = "h200"        # a vendor profile: no calibration run in the tests


def _tiny_moe_config():
    import transformers
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2)


def _tiny_mla_config():
    import transformers

    from dcp_compile.models.mla import HF_DEEPSEEK_TINY
    return transformers.DeepseekV3Config(**{**HF_DEEPSEEK_TINY, "first_k_dense_replace": 1})


def _program(model, tp, dcp, *, batch=2, context=64, **kw):
    shapes = StepShapes.fitting(batch, 16, context + 1, block_size=16, dcp=dcp)
    return dcp_compile.transform(model, tp=tp, dcp=dcp, shapes=shapes, check=False, **kw)


def test_demo_layouts_are_legal_and_refusals_name_their_rule():
    # demo: 8 query heads, 2 KV heads; on 4 ranks decode DCP needs dcp <= tp / kv heads = 2.
    p = planner.plan(demo_model(), ranks=4, context_len=100, batch=2, hardware=H200,
                     combines=("all_to_all",))
    assert {c.layout.dcp for c in p.ranked} == {1, 2}
    for c in p.ranked:
        DCPConfig(tp=c.layout.tp, dcp=c.layout.dcp, block_size=c.layout.block_size,
                  interleave_size=c.layout.interleave_size, combine=c.layout.combine,
                  num_q_heads=8, num_kv_heads=2)           # raises if it were illegal
    assert {r.layout.dcp for r in p.refused} == {4}
    assert all("dcp <= tp // num_kv_heads" in r.rule for r in p.refused)
    times = [c.prediction.step_seconds for c in p.ranked]
    assert times == sorted(times)
    assert "refused tp4 dcp4" in p.format_table()


def test_moe_config_gets_expert_parallel_layouts_mla_config_its_latent_cache():
    moe = planner.plan(_tiny_moe_config(), ranks=2, context_len=40, batch=2, hardware=H200,
                       dcps=(1,))
    assert {c.layout.expert_parallel for c in moe.ranked} == {False, True}
    mla = planner.plan(_tiny_mla_config(), ranks=2, context_len=40, batch=2, hardware=H200,
                       dcps=(2,), combines=("all_gather",), interleave_sizes=(8, 16))
    # MLA: one latent "KV head" ([latent ; k_pe], replicated over tp); dcp shards its tokens.
    assert {(c.layout.interleave_size, c.layout.expert_parallel) for c in mla.ranked} == {
        (8, False), (16, False), (8, True), (16, True)}       # its layers after the first: MoE
    c = mla.ranked[0]
    assert c.breakdown.kv_tokens == 24            # 40 tokens in runs of 8 or 16 over 2 ranks
    cfg = _tiny_mla_config()
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert c.breakdown.kv_bytes_per_token == cfg.num_hidden_layers * latent * 4


@pytest.mark.parametrize("tp,dcp,ep", [(4, 2, False), (2, 1, False), (2, 1, True)],
                         ids=["demo-tp4-dcp2", "demo-tp2-dcp1", "moe-tp2-ep"])
def test_weight_bytes_equal_the_ranks_state_dict(tp, dcp, ep):
    if ep:
        import transformers
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_tiny_moe_config()).eval()
    else:
        model = demo_model()
    program = _program(model, tp, dcp, expert_parallel=ep)
    for rank in range(tp):
        state = program.state_dict_for(rank)
        real = sum(t.numel() * t.element_size() for n, t in state.items() if n != RANK_INPUT)
        assert planner.weight_bytes(program, rank) == real
    experts, read = planner.expert_weights_read(program)
    if ep:    # 4 experts, top-2, batch 2: an expert is skipped with chance (1 - 2/4)^2
        assert 0 < experts < real and read == int(experts * (1 - 0.5 ** 2))
    else:
        assert experts == read == 0


def test_collectives_are_the_programs_own():
    program = _program(demo_model(), 4, 2)
    b = planner.breakdown(program, 64)
    per_layer = program.collectives_per_layer("decode")
    model_wide = program.model_collectives("decode")
    expected = sum(v * program.num_layers for v in per_layer.values()) + sum(
        model_wide.values())
    assert b.collective_count == expected
    assert b.graph_ops == sum(1 for n in program.graphs["decode"].graph.nodes
                              if n.op == "call_function")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 0],
                         ids=["len=1", "len=I*dcp-1", "len=I*dcp", "len=I*dcp+1",
                              "len=B*dcp-1", "len=B*dcp", "len=B*dcp+1", "empty"])
def test_busiest_rank_tokens_count_the_owned_positions(n):
    config = DCPConfig(tp=4, dcp=2, block_size=16, interleave_size=8)
    owners = [(p // 8) % 2 for p in range(n)]
    expected = max([owners.count(r) for r in range(2)])
    assert planner.busiest_rank_tokens(n, config) == expected


def test_more_context_more_kv_and_dcp_halves_the_kv_read_per_rank():
    model = demo_model()
    dcp1, dcp2 = _program(model, 4, 1, context=256), _program(model, 4, 2, context=256)
    short, long = planner.breakdown(dcp1, 64), planner.breakdown(dcp1, 256)
    assert long.kv_bytes == 4 * short.kv_bytes
    assert planner.breakdown(dcp2, 256).kv_bytes * 2 == long.kv_bytes
    hw = hardware.profile(H200)
    assert planner.predict(long, hw, 4).seconds["kv"] > planner.predict(short, hw, 4).seconds["kv"]
    # the weights are the same; dcp moves KV reads into collectives
    assert planner.breakdown(dcp2, 256).weight_bytes == long.weight_bytes


def test_unknown_numbers_are_named_not_guessed():
    for name, prof in hardware.PROFILES.items():
        for f in ("memory_bytes", "memory_bandwidth", "link_bandwidth", "link_latency",
                  "peak_flops"):
            assert f in prof.sources, (name, f)
            if getattr(prof, f) is None:
                assert prof.sources[f].startswith("not found"), (name, f)
    p = planner.plan(demo_model(), ranks=2, context_len=64, hardware=H200, dcps=(1,))
    assert "collective latency" in p.best.prediction.unpriced
    assert "not priced" in p.format_table()


def test_bad_sizes_modes_and_knobs_are_refused_by_name():
    with pytest.raises(dcp_compile.DCPInputError, match="context_len"):
        planner.plan(demo_model(), ranks=2, context_len=0, hardware=H200)
    with pytest.raises(dcp_compile.DCPInputError, match="unknown hardware"):
        hardware.profile("tpu-v9")
    with pytest.raises(dcp_compile.DCPInputError, match="mode='train'"):
        planner.plan(demo_model(), ranks=2, context_len=64, mode="train", hardware=H200)
    with pytest.raises(dcp_compile.DCPInputError, match="combines=.*decode knob"):
        planner.plan(demo_model(), ranks=2, context_len=64, mode="prefill", hardware=H200,
                     combines=("all_to_all",))
    with pytest.raises(dcp_compile.DCPInputError, match="chunks=.*prefill knob"):
        planner.plan(demo_model(), ranks=2, context_len=64, hardware=H200, chunks=(16,))
    with pytest.raises(dcp_compile.DCPInputError, match="each chunk"):
        planner.plan(demo_model(), ranks=2, context_len=64, mode="prefill", hardware=H200,
                     chunks=(0,))


def _prefill_program(tp, dcp, chunk, context):
    shapes = StepShapes.fitting(2, chunk, context + 1, block_size=16, dcp=dcp)
    return dcp_compile.transform(demo_model(), tp=tp, dcp=dcp, mode="prefill", shapes=shapes,
                                 check=False)


def test_prefill_step_reads_its_prior_and_the_programs_collectives():
    program = _prefill_program(4, 2, 32, 100)
    first, later = planner.prefill_breakdown(program, 0), planner.prefill_breakdown(program, 64)
    # the busiest rank holds its share of prior + chunk (runs of 16 over 2 ranks)
    assert first.kv_tokens == 16 and later.kv_tokens == 48
    assert later.kv_bytes == 3 * first.kv_bytes
    assert later.flops > first.flops                       # attention over more keys
    per_layer = program.collectives_per_layer("prefill")
    expected = sum(v * program.num_layers for v in per_layer.values()) + sum(
        program.model_collectives("prefill").values())
    assert first.collective_count == later.collective_count == expected
    assert first.graph_ops == sum(1 for n in program.graphs["prefill"].graph.nodes
                                  if n.op == "call_function")


def test_time_to_first_token_sums_the_prompts_chunks():
    program = _prefill_program(4, 2, 32, 100)
    chip = hardware.HardwareProfile("chip", memory_bytes=1e12, memory_bandwidth=1e9,
                                    link_bandwidth=1e9, link_latency=1e-5, peak_flops=1e10)
    last, p = planner.time_to_first_token(program, 100, chip, 4)
    steps = [planner.predict(planner.prefill_breakdown(program, i * 32), chip, 4)
             for i in range(4)]                             # 100 tokens: 4 chunks of 32
    assert p.steps == 4 and last == planner.prefill_breakdown(program, 96)
    assert p.step_seconds == pytest.approx(sum(s.step_seconds for s in steps))
    for term in planner.Term:
        assert p.seconds[term] == pytest.approx(sum(s.seconds[term] for s in steps))
    assert p.dominant == max(p.seconds, key=p.seconds.get)


def test_prefill_plan_ranks_layouts_and_chunks_by_time_to_first_token():
    chip = hardware.HardwareProfile("chip", memory_bytes=1e12, memory_bandwidth=1e9,
                                    link_bandwidth=1e9, link_latency=1e-3, peak_flops=1e10)
    p = planner.plan(demo_model(), ranks=2, context_len=64, batch=2, mode="prefill",
                     hardware=chip, chunks=(16, 64))
    assert p.mode == "prefill" and not p.refused
    got = {(c.layout.dcp, c.layout.chunk): c for c in p.ranked}
    assert set(got) == {(1, 16), (1, 64), (2, 16), (2, 64)}
    times = [c.prediction.step_seconds for c in p.ranked]
    assert times == sorted(times)
    small, whole = got[(2, 16)].prediction, got[(2, 64)].prediction
    assert (small.steps, whole.steps) == (4, 1)
    # the same collectives per step, four steps: four times the latency
    count = got[(2, 16)].breakdown.collective_count
    assert count == got[(2, 64)].breakdown.collective_count
    assert small.seconds["collectives"] - whole.seconds["collectives"] == pytest.approx(
        3 * count * 1e-3, rel=0.05)
    assert "chunk16" in got[(2, 16)].layout.label() and "TTFT" in p.format_table()
    for c in p.ranked:
        assert c.tokens_per_s_per_chip == pytest.approx(2 * 64 / c.prediction.step_seconds / 2)


def test_plan_json_cli(capsys, tmp_path):
    from dcp_compile.cli import main
    _tiny_moe_config().save_pretrained(tmp_path)
    assert main(["plan", "--hf-config", str(tmp_path / "config.json"), "--ranks", "2",
                 "--context", "48", "--batch", "2", "--hardware", "b200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["name"] == "b200"
    times = [c["prediction"]["step_seconds"] for c in out["ranked"]]
    assert times and times == sorted(times)
    first = out["ranked"][0]["breakdown"]
    assert {"weight_bytes", "kv_bytes", "collective_bytes", "collective_count",
            "flops"} <= set(first)
    assert out["ranked"][0]["prediction"]["dominant"] in set(planner.Term)


def test_plan_cli_prefill_mode(capsys):
    from dcp_compile.cli import main
    assert main(["plan", "--ranks", "2", "--context", "48", "--mode", "prefill",
                 "--chunks", "16", "48", "--hardware", "h200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "prefill"
    assert {r["layout"]["chunk"] for r in out["ranked"]} == {16, 48}
    assert {r["prediction"]["steps"] for r in out["ranked"]} == {3, 1}


def test_this_machine_profile_is_read_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DCP_COMPILE_CACHE", str(tmp_path))
    with pytest.raises(dcp_compile.DCPInputError, match="not calibrated"):
        hardware.profile("this-machine", calibrate_now=False)
    fake = hardware.with_overrides(hardware.PROFILES["h200"], name="this-machine",
                                   shared_host=True, op_overhead=1e-6)
    hardware.cache_path().parent.mkdir(parents=True, exist_ok=True)
    hardware.cache_path().write_text(json.dumps(fake.to_json()))
    assert hardware.profile("this-machine") == fake


def _breakdown(**kw):
    base = dict(weight_bytes=1000, weight_bytes_read=1000, kv_bytes=3000, kv_tokens=10, kv_bytes_per_token=100,
                collective_bytes=500, collective_count=4, collectives={}, flops=0,
                graph_ops=10)
    return planner.Breakdown(**{**base, **kw})


def test_prediction_terms_on_a_chip_and_on_a_shared_host():
    chip = hardware.HardwareProfile("chip", memory_bytes=10_000, memory_bandwidth=1000.0,
                                    link_bandwidth=100.0, link_latency=0.5, peak_flops=1.0)
    p = planner.predict(_breakdown(), chip, ranks=4)
    assert p.seconds == {"weights": 1.0, "kv": 3.0, "flops": 0.0, "collectives": 4 * 0.5 + 5.0,
                         "ops": 0.0}
    assert p.step_seconds == 4.0 + 7.0 and p.dominant == "collectives"
    # 3 sequences' KV (1000 each) fit in the 9000 bytes the weights leave
    assert planner.kv_capacity(_breakdown(), chip, 4, batch=3) == 9
    host = hardware.with_overrides(chip, shared_host=True, cores=2, op_overhead=0.1)
    h = planner.predict(_breakdown(), host, ranks=4)
    assert h.seconds["kv"] == 2 * 3.0            # 4 ranks take turns on 2 cores
    assert h.seconds["ops"] == 4 * 10 * 0.1      # dispatch never overlaps
    assert planner.kv_capacity(_breakdown(), host, 4, batch=3) == (10_000 - 4000) // 4000

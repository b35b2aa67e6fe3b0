"""Weights by name (issue #36): a program compiled from a meta-device model reads each rank's
shard from a Hugging Face checkpoint, bit-equal to the shard of the program compiled with the
real weights; only the rank's slices are read; bad checkpoints are named DCPInputErrors."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import dcp_compile
from dcp_compile.meta_init import empty_weights, meta_model
from dcp_compile.runtime.errors import DCPInputError
from dcp_compile.runtime.program.checkpoint import Checkpoint, Piece, WeightSource
from dcp_compile.runtime.program.program_file import load_program
from dcp_compile.runtime.program.shards import ShardSpec

from helpers import seeded_weights

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, max_position_embeddings=64)
MLA = dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=12, num_key_value_heads=8, n_routed_experts=8, num_experts_per_tok=2,
           n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, norm_topk_prob=True)
# id -> (config class, config overrides, transform kwargs): what each one's shards exercise.
MODELS = {
    "llama-gqa": ("LlamaConfig", {}, {}),
    "qwen2-biases": ("Qwen2Config", {}, {}),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True), {}),
    "phi3-fused-qkv-gate-up": ("Phi3Config", {}, {}),
    "mixtral-experts-tp": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2), {}),
    "mixtral-experts-ep": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2),
                           dict(expert_parallel=True)),
    "deepseek_v3-mla": ("DeepseekV3Config", MLA, {}),
}
TP, DCP = 4, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(model_id: str, dtype: torch.dtype, seed: int = 0):
    config_name, overrides, _ = MODELS[model_id]
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    # as from_pretrained(dtype=) builds it: parameters in dtype, RoPE tables in float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    seeded_weights(model, seed)
    with torch.no_grad():    # persistent buffers come from the checkpoint too
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    return model


def save(model, directory, max_shard_size="40KB") -> str:
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return str(directory)


def assert_bit_equal(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for k in expected:
        a, e = actual[k], expected[k]
        assert a.dtype == e.dtype and a.shape == e.shape, (k, a.dtype, e.dtype, a.shape, e.shape)
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           e.view(torch.uint8) if e.is_floating_point() else e), k


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("model_id", list(MODELS))
def test_meta_program_reads_the_real_programs_shards(model_id, dtype, tmp_path):
    kwargs = MODELS[model_id][2]
    model = build(model_id, DTYPES[dtype])
    real = dcp_compile.transform(model, TP, DCP, check=False, **kwargs)
    directory = save(model, tmp_path / "ckpt")
    meta = dcp_compile.transform(meta_model(directory), TP, DCP, **kwargs)
    assert meta.weightless and not real.weightless
    assert set(meta.weight_names) == set(real.weight_names)
    checkpoint_bytes = sum(os.path.getsize(tmp_path / "ckpt" / f)
                           for f in os.listdir(tmp_path / "ckpt") if f.endswith(".safetensors"))
    for rank in range(TP):
        state, stats = meta.read_checkpoint(rank, directory)
        assert_bit_equal(state, real.state_dict_for(rank))
        # only the rank's slices: the named weights' shard bytes, each read once
        named = sum(state[n].numel() * state[n].element_size() for n in meta.weight_names)
        assert stats.bytes_read == named < checkpoint_bytes


def test_weight_names_are_the_models_own(tmp_path):
    model = build("qwen2-tied", torch.float32)
    program = dcp_compile.transform(model, TP, DCP, check=False)
    names = {fqns[0] for fqns in program.weight_names.values()}
    assert "model.layers.0.self_attn.q_proj.bias" in names
    tied = [fqns for fqns in program.weight_names.values() if len(fqns) > 1]
    assert tied and set(tied) == {("model.embed_tokens.weight", "lm_head.weight")}
    assert not any(fqn.startswith("model.model.") for fqn in names)   # no wrapper prefix


def test_hf_prepare_names_the_wrapped_model():
    model = build("llama-gqa", torch.float32)
    from dcp_compile import hf
    program = dcp_compile.transform(hf.prepare(model), TP, DCP, check=False)
    assert {f for fqns in program.weight_names.values() for f in fqns} == \
        set(model.state_dict())


def test_experts_source_is_the_checkpoints_per_expert_tensors():
    model = build("mixtral-experts-tp", torch.float32)
    program = dcp_compile.transform(model, TP, DCP, check=False)
    source = program.weight_sources["model.layers.0.mlp.experts.gate_up_proj"]
    keys = [p.key for p in source.pieces]
    prefix = "model.layers.0.block_sparse_moe.experts"
    assert keys == [f"{prefix}.{e}.w{w}.weight" for w in (1, 3) for e in range(8)]
    assert [p.offset for p in source.pieces[7:9]] == [(7, 0, 0), (0, 64, 0)]
    assert program.weight_sources["model.layers.0.mlp.gate.weight"].pieces[0].key == \
        "model.layers.0.block_sparse_moe.gate.weight"


def test_failing_conversion_rules_leave_the_transform_and_refuse_the_load(llama, monkeypatch):
    import transformers.core_model_loading as loading

    from dcp_compile.frontends.hf_checkpoint import checkpoint_sources

    def broken(model, state):
        raise ValueError("no rule")
    monkeypatch.setattr(loading, "revert_weight_conversion", broken)
    sources = checkpoint_sources(build("llama-gqa", torch.float32))
    why = sources["model.norm.weight"].unsupported
    assert "conversion rules failed on LlamaForCausalLM (ValueError: no rule)" in why
    _, directory = llama
    with pytest.raises(DCPInputError, match=r"weight model\.norm\.weight cannot be read"):
        Checkpoint(directory).source_of(("model.norm.weight",), sources["model.norm.weight"],
                                        torch.empty(64))


def test_weightless_program_file(tmp_path):
    model = build("llama-gqa", torch.float32)
    program = dcp_compile.transform(model, TP, DCP, check=False)
    directory = save(model, tmp_path / "ckpt")
    program.save(tmp_path / "full.dcp")
    program.save(tmp_path / "weightless.dcp", weights=False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert os.path.getsize(tmp_path / "full.dcp") - os.path.getsize(
        tmp_path / "weightless.dcp") > 0.9 * weights
    loaded = load_program(tmp_path / "weightless.dcp")
    assert loaded.weightless and loaded.weight_names == program.weight_names
    with pytest.raises(DCPInputError, match=r"holds no weights .*weight model\.\S+ has no "
                                            r"value\. Pass the model's checkpoint"):
        loaded.state_dict_for(0)
    for rank in range(TP):
        assert_bit_equal(loaded.state_dict_for(rank, checkpoint=directory),
                         program.state_dict_for(rank))


def test_meta_model_keeps_buffers_real():
    config = transformers.LlamaConfig(**BASE)
    model = meta_model(config)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())          # RoPE's, not persistent
    with empty_weights():
        layer = torch.nn.Linear(4, 4)
        layer.register_buffer("table", torch.ones(2), persistent=False)
        layer.register_buffer("bias2", torch.ones(2))
    assert layer.weight.is_meta and layer.weight.requires_grad
    assert not layer.table.is_meta and layer.bias2.is_meta
    assert not torch.nn.Linear(4, 4).weight.is_meta        # the patch is undone


def test_meta_buffers_are_refused_naming_the_fix(tmp_path):
    model = build("llama-gqa", torch.float32)
    directory = save(model, tmp_path / "ckpt")
    with torch.device("meta"):
        on_meta = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    program = dcp_compile.transform(on_meta, TP, DCP)
    with pytest.raises(DCPInputError, match=r"a buffer the checkpoint does not hold\) is on "
                                            r"the meta device.*meta_init\.empty_weights"):
        program.state_dict_for(0, checkpoint=directory)


def test_meta_model_with_check_is_refused():
    with pytest.raises(dcp_compile.DCPTransformError, match="meta"):
        dcp_compile.transform(meta_model(transformers.LlamaConfig(**BASE)), TP, DCP,
                              check=True)


# -- bad checkpoints: each a DCPInputError naming the tensor or file ---------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A weightless llama program and the directory of its one-file checkpoint."""
    directory = tmp_path_factory.mktemp("llama")
    model = build("llama-gqa", torch.float32)
    save(model, directory, max_shard_size="1GB")
    return dcp_compile.transform(meta_model(str(directory)), TP, DCP), directory


def _rewrite(directory, change):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _copy(src, dst):
    dst.mkdir()
    for f in os.listdir(src):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


Q = "model.layers.1.self_attn.q_proj.weight"
BAD = {
    "missing-tensor": (lambda t: t.pop(Q), rf"has no tensor {Q}\. Pass the checkpoint"),
    "wrong-shape": (lambda t: t.update({Q: t[Q][:32]}),
                    rf"tensor {Q} has shape \[32, 64\]; the program expects \[64, 64\].*"
                    r"config does not match the program"),
    "wrong-dtype": (lambda t: t.update({Q: t[Q].to(torch.int32)}),
                    rf"tensor {Q} is of dtype torch.int32; weight {Q} is torch.float32"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tensor(llama, tmp_path, case):
    program, directory = llama
    bad = _copy(directory, tmp_path / "bad")
    change, message = BAD[case]
    _rewrite(bad, change)
    with pytest.raises(DCPInputError, match=message):
        program.state_dict_for(0, checkpoint=bad)


@pytest.mark.parametrize("how", ["truncated", "corrupt-header"])
def test_broken_file(llama, tmp_path, how):
    program, directory = llama
    bad = _copy(directory, tmp_path / "bad")
    path = bad / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\xff" * 64 + data[64:])
    with pytest.raises(DCPInputError, match=r"checkpoint file .*model\.safetensors is not a "
                                            r"readable safetensors file.*truncated or corrupt"):
        program.state_dict_for(0, checkpoint=bad)


def test_index_naming_a_missing_file(tmp_path):
    model = build("llama-gqa", torch.float32)
    directory = save(model, tmp_path / "ckpt")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    os.remove(os.path.join(directory, files[1]))
    program = dcp_compile.transform(meta_model(directory), TP, DCP)
    with pytest.raises(DCPInputError, match=rf"index .* names file {files[1]}, which is not in"):
        program.state_dict_for(0, checkpoint=directory)


def test_checkpoint_of_another_config(llama, tmp_path):
    program, _ = llama
    other = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**BASE, "intermediate_size": 128}))
    directory = save(other, tmp_path / "other", max_shard_size="1GB")
    with pytest.raises(DCPInputError, match=r"mlp\.gate_proj\.weight has shape \[128, 64\]; "
                                            r"the program expects \[64, 64\]"):
        program.state_dict_for(0, checkpoint=directory)


@pytest.mark.parametrize("where", ["no-directory", "no-safetensors", "bad-index"])
def test_not_a_checkpoint(llama, tmp_path, where):
    program, _ = llama
    target = tmp_path / "x"
    if where != "no-directory":
        target.mkdir()
    if where == "bad-index":
        (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    message = {"no-directory": "no checkpoint directory", "no-safetensors": "has no "
               "model.safetensors.index.json and no", "bad-index": "no readable 'weight_map'"}
    with pytest.raises(DCPInputError, match=message[where]):
        program.state_dict_for(0, checkpoint=target)


def test_program_without_names_is_refused(llama, tmp_path):
    program, directory = llama
    import dataclasses
    nameless = dataclasses.replace(program, weight_names={})
    with pytest.raises(DCPInputError, match="records no checkpoint names"):
        nameless.state_dict_for(0, checkpoint=directory)


def test_weightless_save_of_a_nameless_program_is_refused(llama, tmp_path):
    import dataclasses
    program, _ = llama
    with pytest.raises(DCPInputError, match="records none: no rank could load it"):
        dataclasses.replace(program, weight_names={}).save(tmp_path / "x.dcp", weights=False)
    assert not (tmp_path / "x.dcp").exists()


def test_unsupported_conversion_is_named(llama):
    _, directory = llama
    with pytest.raises(DCPInputError, match=r"weight w cannot be read .*: transformers "
                                            r"converts it with \[\('Chunk', 0\)\]"):
        Checkpoint(directory).source_of(("w",), WeightSource(
            (), unsupported="transformers converts it with [('Chunk', 0)]"), torch.empty(1))


# -- the reader's pieces and boxes --------------------------------------------------------------


def test_boxes_of_a_fused_weight_are_its_segments_slices():
    spec = ShardSpec(dim=0, pieces=2, group=4, replicas=2, segments=((8, 2, 2), (4, 2, 2)))
    assert spec.boxes((12, 3), 2) == [((4, 8), (0, 3)), ((10, 12), (0, 3))]
    full = torch.arange(36).reshape(12, 3)
    assert torch.equal(spec.shard(full, 2), torch.cat([full[4:8], full[10:12]]))


@pytest.mark.parametrize("dim", [0, 1])
def test_a_reordered_weight_is_cut_after_the_reordering(dim, tmp_path):
    """ShardSpec.perm (tiled K/V heads read as GQA, passes/untile_kv_heads.py): rank r holds
    piece r of ``full.index_select(dim, perm)``; its boxes are the checkpoint's runs of
    rows, and a checkpoint read of them is that shard (8 heads of 2 tiled over 2 KV heads:
    h' = g * 4 + j is h = j * 2 + g)."""
    perm = tuple((h % 4 * 2 + h // 4) * 2 + i for h in range(8) for i in range(2))
    full = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    full = full if dim == 0 else full.t().contiguous()
    spec = ShardSpec(dim, 4, 4, perm=perm)
    reordered = full.index_select(dim, torch.tensor(perm))
    save_file({"w": full}, tmp_path / "model.safetensors")
    ckpt = Checkpoint(tmp_path)
    source = WeightSource((Piece("w", (0, 0), tuple(full.shape)),))
    for rank in range(4):
        want = reordered.narrow(dim, 4 * rank, 4)
        assert torch.equal(spec.shard(full, rank), want)
        assert len(spec.boxes(full.shape, rank)) == 2          # two heads, 4 rows apart
        assert torch.equal(ckpt.read_shard(source, full, spec.boxes(full.shape, rank), dim),
                           want)
    assert spec.shape(full.shape) == tuple(want.shape)


def test_pieces_tile_a_stacked_fused_weight(tmp_path):
    """gate_e and up_e per expert -> [E, 2I, H], read box by box (an EP and a TP shard)."""
    gen = torch.Generator().manual_seed(0)
    gate = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    up = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    save_file({**{f"g{e}": t for e, t in enumerate(gate)},
               **{f"u{e}": t for e, t in enumerate(up)}}, tmp_path / "model.safetensors")
    full = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])       # [2, 8, 3]
    source = WeightSource(tuple(Piece(f"{k}{e}", (e, 4 * (k == "u"), 0), (4, 3), stacked=0)
                                for k in "gu" for e in range(2)))
    ckpt = Checkpoint(tmp_path)
    for spec in (ShardSpec(0, 2, 2), ShardSpec(1, 2, 2, segments=((4, 2, 1), (4, 2, 1)))):
        for rank in range(2):
            got = ckpt.read_shard(source, full, spec.boxes(full.shape, rank), spec.dim)
            assert torch.equal(got, spec.shard(full, rank))
    assert ckpt.stats.bytes_read == 2 * full.numel() * 4


@pytest.mark.parametrize("model_id", ["llama-gqa", "mixtral-experts-ep"])
def test_threaded_world_decodes_from_the_checkpoint(model_id, tmp_path):
    """Every rank of a threaded world reads its own shards (rank_engine(checkpoint=)) of a
    weightless program file and decodes the model's own greedy tokens."""
    from dcp_compile.runtime.serving.engine import StepShapes
    from dcp_compile.verify import run_threaded_program

    from helpers import assert_runs_match, full_forward_reference, prompts_of
    model = build(model_id, torch.float32)
    directory = save(model, tmp_path / "ckpt")
    shapes = StepShapes(batch=2, context_len=8, max_blocks=4, num_blocks=12)
    program = dcp_compile.transform(meta_model(directory), TP, DCP, block_size=4,
                                    shapes=shapes, **MODELS[model_id][2])
    program.save(tmp_path / "p.dcp")
    loaded = load_program(tmp_path / "p.dcp")
    prompts, steps = prompts_of((3, 8), vocab=BASE["vocab_size"]), 4
    tokens, logits = full_forward_reference(model, prompts, steps)
    runs = run_threaded_program(loaded, prompts, steps, checkpoint=directory)
    assert_runs_match(runs, tokens, logits, atol=1e-4)


# -- the command line -----------------------------------------------------------------------------


def test_cli_compile_writes_a_weightless_program_and_verify_reads_the_checkpoint(llama,
                                                                                tmp_path,
                                                                                capsys):
    from dcp_compile import cli
    _, directory = llama
    out = tmp_path / "p.dcp"
    assert cli.main(["compile", "--checkpoint", str(directory), "--tp", str(TP), "--dcp",
                     str(DCP), "--max-model-len", "64", "--chunk", "16", "-o", str(out)]) == 0
    assert "no weight data" in capsys.readouterr().out
    program = load_program(out)
    assert program.weightless and os.path.getsize(out) < 2 * 2**20
    reference = dcp_compile.transform(build("llama-gqa", torch.float32), TP, DCP, check=False)
    assert_bit_equal(program.state_dict_for(3, checkpoint=directory),
                     reference.state_dict_for(3))
    assert cli.main(["verify", "--checkpoint", str(directory), "--tp", str(TP), "--dcp",
                     str(DCP), "--steps", "3", "--lengths", "2,9"]) == 0
    assert "OK: backend=threads" in capsys.readouterr().out


def test_cli_checkpoint_verify_refuses_what_it_does_not_run(llama, capsys):
    from dcp_compile import cli
    _, directory = llama
    assert cli.main(["verify", "--checkpoint", str(directory), "--tp", str(TP), "--dcp",
                     str(DCP), "--mode", "prefill"]) == 2
    assert "--checkpoint verifies plain greedy decoding on threads" in capsys.readouterr().err


def test_cli_hf_config_of_an_eager_only_model_runs(tmp_path, capsys):
    """Gemma-2 has no sdpa in transformers: the default falls back to eager."""
    from dcp_compile import cli
    config = transformers.Gemma2Config(**{**BASE, "head_dim": 8, "num_hidden_layers": 2})
    config.save_pretrained(tmp_path)
    assert cli.main(["verify", "--hf-config", str(tmp_path), "--tp", str(TP), "--dcp",
                     str(DCP), "--steps", "2", "--lengths", "2,5"]) == 0
    assert "OK: backend=threads" in capsys.readouterr().out
    with pytest.raises(DCPInputError, match=r"builds Gemma2Config with none of \['sdpa'\]"):
        meta_model(config, attn_implementation="sdpa")

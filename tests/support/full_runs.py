"""The suite's full runs: each large matrix, corpus or fuzz runs a representative slice in the
README's test command, and in full behind its switch (docs/testing.md). ``DCP_FULL=1`` turns every switch on.

``SWITCHES`` is the one list (docs/testing.md's table is checked against it): a test module reads
its switch with ``full(SWITCH)``, never ``os.environ`` directly, so ``DCP_FULL`` reaches it.
"""

from __future__ import annotations

import os

EVERYTHING = "DCP_FULL"
ON = ("1", "all")

# switch -> (test module, under tests/; what the full run adds to the slice)
SWITCHES: dict[str, tuple[str, str]] = {
    "DCP_ALIBI_FULL": ("frontends/test_alibi.py",
                       "every ALiBi form x mode x tp/dcp (the slice: one form per mode), "
                       "the slopes computed in forward in decode too, transformers' Bloom "
                       "prefill at tp=4/dcp=2 too (the slice: tp=8/dcp=4)"),
    "DCP_BUCKET_CASES": ("runtime/test_buckets.py",
                         "decode and prefill at tp=8/dcp=4 and tp=4/dcp=2, threads and XLA"),
    "DCP_CHUNKED_FULL": ("frontends/test_chunked_attention.py",
                         "every chunk length x tp/dcp x mode of Llama 4, through hf.prepare "
                         "and its own sdpa / eager attention (the slice: two of each)"),
    "DCP_CORRUPT_FULL": ("runtime/test_corrupt_files.py",
                         "1000 corrupt program files and 1000 forged safetensors headers "
                         "instead of 100 each"),
    "DCP_CORPUS": ("corpora/test_hf_corpus.py",
                   "every cell of the transformers corpus vs its table in docs/models.md"),
    "DCP_DSA_FULL": ("frontends/test_dsa_exact.py",
                     "DeepSeek-V3.2 and GLM-5 on dcp shards: every tp/dcp layout x model x "
                     "decode/prefill (the slice: four)"),
    "DCP_DSA_TRANSFORM_FULL": ("frontends/test_dsa_transform.py",
                               "DeepSeek-V3.2, GLM-5 and GLM-5 / HY-V4 with a shared indexer "
                               "layer through transform: decode and prefill x tp=4/dcp=2 and "
                               "tp=8/dcp=4 (the slice: three), and GLM-5's chunk step"),
    "DCP_FORMS_FULL": ("frontends/test_library_attention_forms.py",
                       "every library attention form in both modes (the slice: each form "
                       "once, decode and prefill in turn)"),
    "DCP_FUZZ_FULL": ("corpora/test_fuzz_sharding.py",
                      "2000 fuzz models instead of 500, one in 4 a hybrid (recurrent "
                      "layers) instead of one in 40 (DCP_FUZZ_EXAMPLES=N sets any count)"),
    "DCP_HYBRID_EXPORT_FULL": ("frontends/test_hybrid_recurrent.py",
                               "the swapped model's export with its states as inputs for every "
                               "hybrid type (the slice: one per swap, qwen3_next, qwen3_5_text, "
                               "bamba, lfm2)"),
    "DCP_HYBRID_FULL": ("frontends/test_hybrid_program.py",
                        "every hybrid family x tp=4/dcp=2 and tp=8/dcp=4, decode and (Mamba2, "
                        "short conv) prefill (the slice: LFM2 decode, Bamba prefill); "
                        "tests/frontends/test_hybrid_hspec.py reads it too: speculative "
                        "decode and prefix caching of Qwen3.5 and Bamba at both layouts and of "
                        "every other family at tp=4/dcp=2 (the slice: Bamba at tp=4/dcp=2, "
                        "Falcon-H1 speculative, Jamba prefix caching); "
                        "frontends/test_hybrid_mamba.py's 30 cells of Nemotron-H, Falcon-H1, "
                        "Zamba2, Jamba and Zamba (the slice: one per family); "
                        "frontends/test_hybrid_lin.py's: Qwen prefill, LFM2-MoE, Kimi Linear, "
                        "Bailing-hybrid, MiniMax (the slice: one cell each but Bailing); "
                        "frontends/test_hybrid_headcut.py's mixers cut by heads: 13 families "
                        "and 5 one-group Mamba2 variants x both layouts, decode and prefill, "
                        "the collectives and the mutations (the slice: Qwen3.5 decode, "
                        "one-group Bamba and MiniMax prefill at tp=4/dcp=2, LFM2 prefill "
                        "at tp=8/dcp=4); "
                        "frontends/test_hybrid_olmo.py's OLMo-hybrid decode and "
                        "prefill at both layouts (the slice: decode at tp=4/dcp=2); "
                        "frontends/test_hybrid_rglru.py's RecurrentGemma decode and prefill "
                        "x both layouts (the slice: its speculative decode at tp=4/dcp=2 in "
                        "test_hybrid_hspec.py); frontends/test_moe_ungated.py's Nemotron-H "
                        "expert-parallel decode and prefill at tp=4/dcp=2 and tp=8/dcp=4 "
                        "(refused: 4 experts, 8 ranks); frontends/test_hybrid_newhyb.py's LFM3 "
                        "and LaRA-mini decode and prefill at both layouts (the slice: LFM3 "
                        "decode at tp=4/dcp=2)"),
    "DCP_HYBRID_XLA_FULL": ("lowering/test_hybrid_xla.py",
                            "hybrid programs lowered and run on XLA:CPU: LFM2 and Bamba x "
                            "decode / prefill x tp=4/dcp=2 and tp=8/dcp=4, and Jamba, "
                            "Qwen3.5, MiniMax, Kimi Linear, RecurrentGemma and Nemotron-H (MoE) "
                            "decode at "
                            "tp=4/dcp=2, speculative decode of Bamba, Qwen3.5 and "
                            "RecurrentGemma (the slice: LFM2 decode at tp=4/dcp=2); "
                            "lowering/test_dsa_xla.py's DSA programs on XLA:CPU: "
                            "DeepSeek-V3.2 decode / prefill x both layouts, GLM-5 with a "
                            "shared indexer layer at tp=4/dcp=2 (the slice: the selection's "
                            "order and ops alone)"),
    "DCP_INDUCTOR": ("runtime/test_inductor.py",
                     "the numerical Inductor cases (compiles take minutes)"),
    "DCP_KV_LAYOUTS_FULL": ("frontends/test_per_layer_kv.py",
                            "Gemma 4's per-layer head_dim, per-layer KV heads and per-layer "
                            "input variants x mode x tp/dcp (the slice: one decode, two "
                            "prefill)"),
    "DCP_MASK_FULL": ("passes/test_mask_proof.py",
                      "every (tp, dcp) x mode of the mask-proof matches"),
    "DCP_MLA_FULL": ("frontends/test_mla.py",
                     "transformers' DeepSeek V3 without a q LoRA at tp=4/dcp=4 and tp=8/dcp=2 "
                     "too (the slice: tp=8/dcp=8; plain MLA runs every layout)"),
    "DCP_MOE_MATRIX": ("frontends/test_moe.py",
                       "every MoE model x mode x tp/dcp x TP/EP x experts implementation x "
                       "prepare/direct; test_moe_backend's TP experts, test_xla's gpt-oss EP "
                       "case and test_moe_libraries' rows (they read test_moe.MATRIX)"),
    "DCP_ODD_FULL": ("frontends/test_hf_odd_forms.py",
                     "DBRX decode and prefill, LongCat-Flash decode, Beam (sdpa, eager) "
                     "decode and prefill, at tp=4/dcp=2 and tp=8/dcp=4 (the slice: DBRX "
                     "prefill at tp=8/dcp=4, LongCat-Flash decode and Beam eager prefill "
                     "at tp=4/dcp=2)"),
    "DCP_POSITIONS_FULL": ("frontends/test_positions.py",
                           "every position form in both modes, every HF family"),
    "DCP_PROOF_FULL": ("passes/test_proofs.py",
                       "all 27 big layouts (dcp 2, 8, 16 x block 64, 256, 1024 x interleave 1, "
                       "16, block) instead of 9"),
    "DCP_RESUME_FULL": ("e2e/test_resume.py",
                        "20 rank losses in a row (SIGKILL, every fifth a SIGSTOP hang) in one "
                        "supervised tp=4/dcp=2 decode generation, 8 in a prefill-mode one "
                        "(every fourth a hang) and 6 in a disaggregated pair (a prefill rank, "
                        "then a decode rank, in turn) plus a decode and a prefill hang in a "
                        "pair, with the detection and resume times"),
    "DCP_SINKS_MATRIX": ("frontends/test_sinks.py", "every sinks form x mode x tp/dcp"),
    "DCP_DISTANCE_BIAS_FULL": ("frontends/test_library_distance_bias.py",
                               "x-transformers' T5 / MLP distance biases and memory key/values "
                               "x mode x tp/dcp (tiled GQA)"),
    "DCP_THIRD_PARTY": ("corpora/test_third_party_corpus.py",
                        "every architecture of torchtune, litgpt, torchtitan, x-transformers, "
                        "nanoGPT and gpt-fast, decode and prefill"),
    "DCP_SOAK_FULL": ("runtime/test_allocator_soak.py",
                      "50,000 steps per seed of the allocator soak instead of 2,000, and 300 "
                      "batches of test_engine_soak's threaded world instead of 8"),
    "DCP_SPEC_FULL": ("runtime/test_speculative.py",
                      "every model x dcp x interleave x K, and XLA"),
    "DCP_XLA_FULL": ("lowering/test_xla.py",
                     "the lowered demo program on XLA:CPU at tp=8/dcp=4 decode and tp=4/dcp=2 "
                     "prefill in f32 too (the slice: each mode in f32 and bf16, each layout "
                     "in each mode)"),
}


def full(switch: str) -> bool:
    """True when ``switch`` (one of SWITCHES) or DCP_FULL is set to 1 (or ``all``)."""
    if switch not in SWITCHES:
        raise KeyError(f"unknown full-run switch {switch!r}: add it to tests/support/full_runs.SWITCHES "
                       f"(known: {sorted(SWITCHES)}).")
    return any(os.environ.get(name, "").lower() in ON for name in (switch, EVERYTHING))


def docs_table() -> str:
    """docs/testing.md's table of switches (tests/repository/test_full_runs.py checks it is the
    page's)."""
    rows = [f"| `{name}=1` | `tests/{module}` | {adds} |"
            for name, (module, adds) in sorted(SWITCHES.items())]
    return "\n".join(["| switch | test module | the full run adds to the slice |",
                      "|---|---|---|", *rows])


if __name__ == "__main__":
    print(docs_table())

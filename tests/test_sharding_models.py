"""Sound sharding: models with fused projections, output gates, norms across heads and literal
head counts transform and match their own single-device forward (fp32 logits within 1e-4,
the same greedy tokens), or transform() refuses. Decode (context + 8 decode steps) on the
threaded world."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.errors import DCPTransformError
from dcp_compile.verify import verify
from runtime.engine import StepShapes

from sharding_models import FeatureConfig, FeatureLM

STEPS = 8
GQA = dict(num_q_heads=8, num_kv_heads=2)       # tp=4, dcp=2: KV heads replicated twice
MHA = dict(num_q_heads=4, num_kv_heads=4)       # tp=4, dcp=1: plain tensor parallelism

FEATURES = {
    "fused-gate-up": (FeatureConfig(mlp="fused", **GQA), 4, 2),
    "fused-qkv-rows": (FeatureConfig(qkv="fused_rows", **GQA), 4, 2),
    "fused-qkv-slices": (FeatureConfig(qkv="fused_slices", mlp="fused", **GQA), 4, 2),
    "fused-qkv-per-head-h3d": (FeatureConfig(qkv="per_head", **MHA), 4, 1),
    "fused-qkv-3hd": (FeatureConfig(qkv="three_first", **MHA), 4, 1),
    "q-output-gate": (FeatureConfig(q_gate=True, **GQA), 4, 2),
    "qk-norm-across-heads": (FeatureConfig(qk_norm="across", **GQA), 4, 2),
    "qk-norm-across-heads-mha": (FeatureConfig(qk_norm="across", **MHA), 4, 1),
    "qk-norm-per-head": (FeatureConfig(qk_norm="per_head", **GQA), 4, 2),
    "literal-head-counts": (FeatureConfig(literal_heads=True, qkv="fused_rows", **GQA), 4, 2),
    "literal-heads-h3d": (FeatureConfig(literal_heads=True, qkv="per_head", **MHA), 4, 1),
    "interleaved-rope": (FeatureConfig(rope="interleaved", **GQA), 4, 2),
    "everything": (FeatureConfig(qkv="fused_slices", mlp="fused", qk_norm="across",
                                 literal_heads=True, rope="interleaved", **GQA), 4, 2),
}

SHAPES = StepShapes.fitting(2, 12, 12 + STEPS + 1, block_size=16, dcp=2)


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_model_decode_matches_single_device(name):
    cfg, tp, dcp = FEATURES[name]
    model = FeatureLM(cfg)
    shapes = StepShapes.fitting(2, 12, 12 + STEPS + 1, block_size=16, dcp=dcp)
    prog = dcp_compile.transform(model, tp=tp, dcp=dcp, mode="decode", shapes=shapes)
    report = verify(model, prog, [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 2]], STEPS)
    assert report.tokens_agree and report.max_abs_error < 1e-4, report

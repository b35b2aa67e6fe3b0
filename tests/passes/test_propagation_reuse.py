"""The pass manager's propagation reuses the result metadata of a repeated op call
(dcp_compile.passes.propagation.call_key): the layers make the same calls. Checked: it is used (the
repeated layers hit it), and every node's value equals a full re-propagation's in shape,
stride, storage offset, dtype and device -- more than the check mode's same_value compares.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.passes import propagation
from dcp_compile.runtime.serving.engine import StepShapes

SHAPES = StepShapes(batch=2, context_len=8, max_blocks=2, num_blocks=5)


def _metadata(v):
    if isinstance(v, (list, tuple)):
        return tuple(_metadata(x) for x in v)
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device)
    return repr(v)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_reused_values_equal_a_full_repropagation_including_offsets(mode, monkeypatch):
    reused = []
    fresh = propagation.fresh_fake

    def spy(meta, *mode):
        reused.append(meta)
        return fresh(meta, *mode)

    monkeypatch.setattr(propagation, "fresh_fake", spy)
    prog = dcp_compile.transform(demo_model(DemoConfig(num_layers=3)), tp=4, dcp=2, mode=mode,
                                 shapes=SHAPES)
    assert len(reused) > 0
    for step, gm in prog.graphs.items():
        incremental = {n.name: _metadata(n.meta.get("val")) for n in gm.graph.nodes}
        propagation.repropagate(gm)
        full = {n.name: _metadata(n.meta.get("val")) for n in gm.graph.nodes}
        bad = [k for k in full if full[k] != incremental[k]]
        assert not bad, f"{step}: {[(k, incremental[k], full[k]) for k in bad[:3]]}"


def test_fresh_fake_rebuilds_views_with_their_offset():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        base = torch.empty(4, 6)
        for v in (base, base[1:, 2:], base.t(), base[:, 3], base[2:2], base.expand(2, 4, 6)):
            meta = propagation.fake_metadata(v)
            assert _metadata(propagation.fresh_fake(meta)) == _metadata(v)

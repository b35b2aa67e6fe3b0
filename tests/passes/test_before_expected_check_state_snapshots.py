"""check_state_snapshots, Before/Expected: a step whose recurrent op reads the
``state_snapshot_slot`` input passes unchanged, and so does a step without that input; a step
with the input and an op that does not read it is refused naming the op, its layer, its source
line and the fix. Then the same refusal through ``transform()`` for a hybrid whose swap rule
is deliberately broken (it forgets the snapshot slots, as Falcon-H1's once did): a width-K
program and a program with state checkpoints are refused, the one-token program is not."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import dcp_compile  # noqa: E402
from dcp_compile.frontends import module_recurrent  # noqa: E402
from dcp_compile.passes.check_state_snapshots import CheckStateSnapshots  # noqa: E402
from dcp_compile.runtime.errors import DCPHybridError  # noqa: E402
from dcp_compile.runtime.serving.engine import StepShapes  # noqa: E402

from before_expected import assert_code, before, code, context, run_alone  # noqa: E402

dcp = torch.ops.dcp
B, S, C, K, SLOTS = 2, 3, 4, 4, 6


def _inputs(**extra):
    return dict(x=torch.randn(B, S, C), w=torch.randn(C, K),
                conv_state=torch.zeros(SLOTS + 1, C, K - 1),
                state_slot=torch.tensor([0, 3]), fresh=torch.tensor([False, False]),
                lengths=torch.tensor([S, S]), **extra)


def _reads(x, w, conv_state, state_slot, fresh, lengths, state_snapshot_slot):
    return dcp.short_conv.default(x, w, None, conv_state, state_slot, fresh, lengths,
                                  state_snapshot_slot)


def _forgets(x, w, conv_state, state_slot, fresh, lengths, state_snapshot_slot):
    return dcp.short_conv.default(x, w, None, conv_state, state_slot, fresh, lengths)


def _one_token(x, w, conv_state, state_slot, fresh, lengths):
    return dcp.short_conv.default(x, w, None, conv_state, state_slot, fresh, lengths)


SNAP = torch.tensor([[1, 2, -1], [4, 5, -1]])


def test_an_op_reading_the_snapshot_slots_is_left_as_it_is():
    gm = before(_reads, **_inputs(state_snapshot_slot=SNAP))
    unchanged = code(gm)
    assert not CheckStateSnapshots(context(4, 2, "decode"))(gm).modified
    gm = run_alone(CheckStateSnapshots(context(4, 2, "decode")), gm)
    assert code(gm) == unchanged
    assert_code(gm, """
        def forward(self, x, w, conv_state, state_slot, fresh, lengths, state_snapshot_slot):
            short_conv_default = dcp.short_conv.default(x, w, None, conv_state, state_slot, fresh, lengths, state_snapshot_slot)
            return short_conv_default
        """)


def test_a_step_without_snapshot_slots_is_left_as_it_is():
    gm = before(_one_token, **_inputs())
    unchanged = code(gm)
    gm = run_alone(CheckStateSnapshots(context(4, 2, "decode")), gm)
    assert code(gm) == unchanged


def test_an_op_that_forgets_the_snapshot_slots_is_refused_naming_it():
    gm = before(_forgets, **_inputs(state_snapshot_slot=SNAP))
    with pytest.raises(DCPHybridError, match=r"recurrent op short_conv_default \(short_conv, "
                                             r"layer unknown: module unknown\) at .* does not "
                                             r"read the step's state_snapshot_slot input \(1 "
                                             r"of the graph's recurrent ops do not\).*"
                                             r"`\*states.snap\(\)` last"):
        run_alone(CheckStateSnapshots(context(4, 2, "decode")), gm)


# -- through transform(): a swap rule that forgets the snapshot slots ------------------------

def _forgetting(rule):
    """``rule`` whose swapped forward never sees the step's snapshot slots (the states it is
    handed share the caches, without ``snapshot_slot``): the bug the pass is for."""
    def forward(m, states):
        return rule.forward(m, dataclasses.replace(states, snapshot_slot=None))
    return dataclasses.replace(rule, forward=forward)


SHAPES = dict(batch=2, context_len=8, max_blocks=4, num_blocks=12)


@pytest.mark.parametrize("shapes,refused", [
    pytest.param(StepShapes(**SHAPES, decode_len=3), True, id="width-3"),
    pytest.param(StepShapes(**SHAPES, state_checkpoints=2), True, id="state-checkpoints"),
    pytest.param(StepShapes(**SHAPES), False, id="one-token")])
def test_a_broken_swap_is_refused_at_transform_time(monkeypatch, shapes, refused):
    """LFM2's short conv rule made to forget the snapshot slots: transform() of a width-K
    program (its decode step) or of a program with state checkpoints (its context step)
    names the first op, its layer and module, its line in the swap and the fix; the one-token
    program, which keeps no snapshots, is built as before."""
    from hybrid_configs import build_hybrid
    broken = tuple(_forgetting(r) if r.cls == "Lfm2ShortConv" else r
                   for r in module_recurrent.RULES)
    monkeypatch.setattr(module_recurrent, "RULES", broken)
    model = build_hybrid("lfm2")
    run = lambda: dcp_compile.transform(model, tp=4, dcp=2, mode="decode",  # noqa: E731
                                        block_size=2, shapes=shapes, check=False)
    if not refused:
        assert run().state_spec() is not None
        return
    with pytest.raises(DCPHybridError) as e:
        run()
    msg = str(e.value)
    step = "decode" if shapes.decode_len > 1 else "context"
    assert (f"(short_conv, layer 0: step.model.model.layers.0.conv) at " in msg
            and "recurrent_mixers.py" in msg and f"this {step} step keeps" in msg
            and "(2 of the graph's recurrent ops do not)" in msg), msg
    print(msg)

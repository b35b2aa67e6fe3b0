"""Corpus types refused for reasons that were not DCP limits (issues #35 / #38), each either
served or refused by a message that names the real reason.

- DBRX (``DbrxExperts``): its MoE is a loop over the experts the batch hits (``nonzero``,
  ``torch.where``: data-dependent token counts), read as one ``dcp.moe``
  (dcp_compile/frontends/module_experts.py, rule ``transformers 5.25 (DBRX)``). Shown: the
  swapped block computes the loop's output; the program matches the model's own forward
  (fp32, 1e-4, greedy tokens; hf_corpus.run_model: prompts of 1, 7, 9, 16 tokens around the
  vblock, garbage block poisoned) in decode and prefill at tp=4/dcp=2 and tp=8/dcp=4; code
  that is not the pinned code is refused.
- LongCat-Flash: its zero experts spread their dummy expert ids with ``//`` on the router's
  integer ids (``aten.floor_divide``), token-wise like any elementwise op
  (passes/op_classes.py, ``UNTAGGED_ELEMENTWISE``); decode matches at both layouts. Its
  prefill stays refused: the experts' sum is reduced over tokens flattened to ``[B*S, H]``
  (the refusal now names that sum's source line).
- JetMoE: its mixture of attention heads (``JetMoeMoA``, query and output projections routed
  per token) is refused by name, the module and its source line, not as an export failure.
- Beam: its attention gate is viewed ``.view_as(attn_output)``; ``canonicalize_ops`` reads it
  as a ``view`` of that (static) shape (``view_as_as_view``): every cell matches.
- Dory: its tiny config now adds up (input + recurrent + output layers = num_hidden_layers);
  its recurrent layers loop with shared weights (``n_recurrent_loops``), refused naming the
  attention module that runs more than once per step.
- DiffLlama: a layer that calls attention twice over one set of keys (differential
  attention) is refused naming both calls and what to change, not as a layer-count mismatch.

The default run is three program cells; ``DCP_ODD_FULL=1`` runs every cell.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_corpus as C  # noqa: E402
from full_runs import full  # noqa: E402

from dcp_compile.frontends import module_experts as mx  # noqa: E402
from dcp_compile.runtime.errors import DCPTransformError  # noqa: E402

FULL = full("DCP_ODD_FULL")

# (type, attention, mode, tp, dcp)
CELLS = [(t, "sdpa", mode, tp, dcp) for t in ("dbrx",) for mode in ("decode", "prefill")
         for tp, dcp in ((4, 2), (8, 4))] + \
    [("longcat_flash", "sdpa", "decode", tp, dcp) for tp, dcp in ((4, 2), (8, 4))] + \
    [("beam", attention, mode, tp, dcp) for attention in ("sdpa", "eager")
     for mode in ("decode", "prefill") for tp, dcp in ((4, 2), (8, 4))]
SLICE = [("dbrx", "sdpa", "prefill", 8, 4), ("longcat_flash", "sdpa", "decode", 4, 2),
         ("beam", "eager", "prefill", 4, 2)]


def _id(cell) -> str:
    t, attention, mode, tp, dcp = cell
    return f"{t}-{attention}-{mode}-tp{tp}-dcp{dcp}"


@pytest.mark.parametrize("cell", CELLS if FULL else SLICE, ids=_id)
def test_program_matches_the_models_own_forward(cell):
    model_type, attention, mode, tp, dcp = cell
    out = C.run_model(C.build(model_type, attention), mode, tp=tp, dcp=dcp)
    assert out.kind == "matches", f"{out.cell()}: {out.message[:600]}"


def _dbrx_experts():
    model = C.build("dbrx", "sdpa")
    return model, model.transformer.blocks[0].ffn


@pytest.mark.parametrize("tokens", [1, 9])
def test_dbrx_experts_as_dcp_moe_compute_its_loop(tokens):
    _, ffn = _dbrx_experts()
    x = torch.randn(2, tokens, ffn.experts.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, ids = ffn.route_tokens_to_experts(ffn.router(x))
        own = ffn.experts(x, ids, weights)
        swapped = mx._dbrx_forward(ffn.experts, mx._dbrx_stack(ffn.experts))(x, ids, weights)
    torch.testing.assert_close(swapped, own, atol=1e-5, rtol=0)


def test_dbrx_experts_whose_code_differs_are_refused(monkeypatch):
    model, ffn = _dbrx_experts()
    cls = type(ffn.experts)
    original = cls.forward

    def forward(self, hidden_states, top_k_index, top_k_weights):   # not the pinned code
        return original(self, hidden_states, top_k_index, top_k_weights)

    monkeypatch.setattr(cls, "forward", forward)
    with pytest.raises(DCPTransformError, match=r"transformers 5\.25 \(DBRX\)'s MoE block.*"
                                                r"DbrxExperts\.forward"):
        mx.blocks(model)


def test_differential_attention_is_refused_naming_both_calls():
    import dcp_compile
    model = C.build("diffllama", "sdpa")
    with pytest.raises(DCPTransformError) as e:
        dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=4)
    message = str(e.value)
    assert "attends over the same keys as" in message and "differential attention" in message
    assert message.count("modeling_diffllama.py\", line") == 2, message
    assert C.reason_of(message) == "differential attention (two softmaxes over one K)"


def test_floor_divide_is_token_wise():
    from passes.op_classes import UNTAGGED_ELEMENTWISE
    from passes.placement.tokens import ROW_RULES as TOKEN_RULES
    aten = torch.ops.aten
    for op in (aten.floor_divide.default, aten.floor_divide.Scalar):
        assert op in UNTAGGED_ELEMENTWISE and op in TOKEN_RULES


def test_longcat_prefill_refusal_names_the_flattened_sum():
    out = C.run_model(C.build("longcat_flash", "sdpa"), "prefill")
    assert out.kind == "refused" and out.reason == "prefill: MLP over flattened tokens [B*S, H]"
    assert "flattened to [B*S, H] at File" in out.message and ", line " in out.message


def test_jetmoe_attention_experts_are_refused_by_name():
    out = C.run_model(C.build("jetmoe", "sdpa"), "decode")
    assert out.kind == "refused", out.cell()
    assert out.reason == "mixture of attention heads (JetMoE: routed projections)", out.message
    assert "model.layers.0.self_attention.experts (JetMoeMoA)" in out.message
    assert "modeling_jetmoe.py, line " in out.message


def test_view_as_becomes_a_view_of_the_static_shape():
    from passes.canonical_ops import canonicalize_ops

    class Gate(torch.nn.Module):
        def forward(self, x, y):
            return x.view_as(y) * y

    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 2, 4)
    gm = torch.export.export(Gate(), (x, y), strict=False).module()
    gm = torch.fx.symbolic_trace(gm) if not isinstance(gm, torch.fx.GraphModule) else gm
    found = canonicalize_ops(gm, set(), dict, forms=("view_as_as_view",))
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert found == {"view_as_as_view": 1}
    assert torch.ops.aten.view_as.default not in targets
    assert torch.ops.aten.view.default in targets
    torch.testing.assert_close(gm(x, y), x.view_as(y) * y)


def test_looped_layers_are_refused_naming_the_module():
    import dcp_compile
    model = C.build("dory", "sdpa")
    assert model.config.n_recurrent_loops > 1
    with pytest.raises(DCPTransformError) as e:
        dcp_compile.transform(model, tp=4, dcp=2, mode="decode", block_size=4)
    message = str(e.value)
    assert "attention module model.model.layers.1.self_attn runs 2 times in one step" in message
    assert "modeling_dory.py\", line" in message and "n_recurrent_loops" in message
    assert C.reason_of(message) == "layers looped with shared weights (recurrent depth)"


def test_a_cat_with_an_empty_part_is_the_cat_without_it():
    """XLM joins a 1-D empty tensor before its keys (torch.cat skips it): the part is
    dropped (``empty_cat_parts_dropped``), so neither the memory key/value reading nor the
    placement meets a join of an empty learned part (XLM crashed there: an IndexError)."""
    from passes.canonical_ops import canonicalize_ops

    class Join(torch.nn.Module):
        def forward(self, k, v):
            return torch.cat([k.new_empty(0), k], dim=2) * 2 + torch.cat([v, v], dim=2)[:, :, :4]

    k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    gm = torch.export.export(Join(), (k, v), strict=False).module()
    found = canonicalize_ops(gm, set(), dict, forms=("empty_cat_parts_dropped",))
    gm.recompile()
    cats = [n for n in gm.graph.nodes if n.target == torch.ops.aten.cat.default]
    assert found == {"empty_cat_parts_dropped": 1} and len(cats) == 1     # v's join stays
    torch.testing.assert_close(gm(k, v), Join()(k, v))


def test_xlm_is_refused_by_name_not_crashed():
    out = C.run_case("xlm", "eager", "decode")
    assert out.kind == "refused" and "written in place" in out.message, out

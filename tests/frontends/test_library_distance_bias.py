"""Score biases of the key-query distance and memory key/values from x-transformers
(issue #35): T5's bucketed relative bias (``rel_pos_bias=True``), an MLP of the distance
(``dynamic_pos_bias=True``) and learned memory key/values (``attn_num_mem_kv``).

Shown here: (1) the distance table built at transform time from the module's own forward
(frontends/module_position_bias.distance_table) gives the module's bias at every (queries,
keys) tried, the swapped model computes its own logits, and a bias that depends on more than
the distance is refused by name; (2) with grouped K/V heads (x-transformers tiles them: the
query heads are permuted, and the table's rows with them) each matches the model's own full
forward (fp32, 1e-4, greedy tokens; prompts of 1, 7, 9, 16 tokens around the interleave
period) in decode and prefill at tp=4/dcp=2 and tp=8/dcp=4. A slice runs by default; every
cell with ``DCP_DISTANCE_BIAS_FULL=1`` (tests/support/full_runs.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import hf_corpus
from dcp_compile.frontends import module_position_bias as mb
from dcp_compile.runtime.errors import DCPTransformError
from full_runs import full
from helpers import seeded_weights

import third_party as T  # noqa: E402

if importlib.util.find_spec("x_transformers") is None:
    pytest.skip("x-transformers is not installed: run scripts/setup.sh "
                "(requirements/corpus.txt)", allow_module_level=True)

FORMS = {"rel-pos-bias": dict(rel_pos_bias=True),
         "dynamic-pos-bias": dict(dynamic_pos_bias=True),
         "mem-kv": dict(rotary_pos_emb=True, attn_num_mem_kv=2)}
WORLDS = [(4, 2), (8, 4)]
CELLS = [(f, m, w) for f in FORMS for m in hf_corpus.MODES for w in WORLDS]
SLICE = [("rel-pos-bias", "decode", (4, 2)), ("mem-kv", "decode", (8, 4))]


def _model(form: str, kv_heads: int = T.KV_HEADS):
    torch.manual_seed(0)
    return seeded_weights(T._x_transformers({**FORMS[form], "attn_kv_heads": kv_heads})()
                          .float().eval(), 0)


def _bias_module(form: str):
    from x_transformers.x_transformers import DynamicPositionBias, RelativePositionBias
    torch.manual_seed(0)
    if form == "rel-pos-bias":
        return RelativePositionBias(scale=T.HEAD_DIM ** 0.5, causal=True, heads=T.HEADS)
    return DynamicPositionBias(dim=16, heads=T.HEADS, depth=2)


@pytest.mark.parametrize("form", ["rel-pos-bias", "dynamic-pos-bias"])
@pytest.mark.parametrize("queries,keys", [(1, 1), (1, 9), (7, 7), (16, 16), (3, 40)])
def test_distance_table_gives_the_modules_own_bias(form, queries, keys):
    module = _bias_module(form)
    tables = mb.Tables(torch.nn.Module(), max_model_len=48)
    sites = [("rel_pos", module, mb.rule_for(module))]
    assert mb.prepare_distance_tables(sites, tables) == 1
    with torch.no_grad():
        want = module(queries, keys)
        with mb.module_position_bias_enabled(sites, tables):
            got = module(queries, keys)
    causal = torch.arange(keys - queries, keys)[:, None] >= torch.arange(keys)[None, :]
    torch.testing.assert_close(got[:, causal], want[:, causal], rtol=0,
                               atol=0 if form == "rel-pos-bias" else mb.DISTANCE_ATOL)
    assert "forward" not in vars(module)            # the swap is undone


def test_a_bias_of_more_than_the_distance_is_refused_by_name():
    module = _bias_module("rel-pos-bias")

    def by_query_position(i, j):   # T5's bias plus a term of the query's own position
        return module(i, j) + torch.arange(j - i, j, dtype=torch.float)[None, :, None]

    with pytest.raises(DCPTransformError, match=r"rel_pos: its score bias is not a function "
                                                r"of the key-query distance only"):
        mb.distance_table("rel_pos", by_query_position, 32)


def test_swapped_model_computes_its_own_forward():
    model = _model("rel-pos-bias")
    sites = mb.bias_sites(model)
    assert [n for n, *_ in sites] == ["attn_layers.rel_pos"]
    tables = mb.Tables(torch.nn.Module(), max_model_len=32)
    mb.prepare_distance_tables(sites, tables)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = T.logits_of(model, ids)
        with mb.module_position_bias_enabled(sites, tables):
            got = T.logits_of(model, ids)
        table = next(iter(tables.holder.buffers()))
        table[:, 1:].mul_(2)                       # another table: another model
        with mb.module_position_bias_enabled(sites, tables):
            other = T.logits_of(model, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (other - want).abs().max() > 1e-3


@pytest.mark.parametrize("form,mode,world", [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-tp{c[2][0]}dcp{c[2][1]}")
    for c in (CELLS if full("DCP_DISTANCE_BIAS_FULL") else SLICE)])
def test_grouped_heads_match_the_models_own_forward(form, mode, world):
    tp, dcp = world
    out = hf_corpus.run_model(_model(form), mode, logits_of=T.logits_of, check=False,
                              tp=tp, dcp=dcp)
    assert out.kind == "matches", (out.cell(), out.message[:800])


def test_memory_keys_with_a_score_bias_are_refused_by_name():
    """Memory key/values beside a relative bias (x-transformers pads the bias with zeros for
    the memory keys) are not read yet: refused naming both, not run wrong."""
    torch.manual_seed(0)
    model = seeded_weights(T._x_transformers(dict(rel_pos_bias=True, attn_num_mem_kv=2,
                                                  attn_kv_heads=2))().float().eval(), 0)
    out = hf_corpus.run_model(model, "prefill", logits_of=T.logits_of, check=False)
    assert out.kind == "refused" and "memory key/values" in out.message \
        and "score bias" in out.message, out.message

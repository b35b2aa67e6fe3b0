"""Position biases the model libraries cache in a buffer, recomputed as formulas of positions
(dcp_compile/frontends/module_position_bias.py): x-transformers' ALiBi
(``alibi_pos_bias=True``) builds its bias once and slices a buffer afterwards.

Shown here: (1) the recomputed bias is the module's own at every (queries, keys) tried, and
the model's logits are unchanged by the swap (a bias with other slopes would change them:
the test can fail); (2) prefill matches the model's own full forward (fp32, 1e-4, greedy
tokens; tests/support/hf_corpus.run_model), the bias proven ALiBi with its slopes padded to
every head (``alibi_num_heads=4`` of 8); decode of this multi-head model is refused for the
real limit (decode DCP needs tp > KV heads), and with grouped K/V heads (x-transformers tiles
them) refused by name, not run wrong; (3) code other than the pinned code is refused, naming
the function. Decode with ALiBi and grouped heads runs in tests/frontends/test_alibi.py
(form ``padded``: the same slopes and a padded mask).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import hf_corpus
from dcp_compile.frontends import module_position_bias as mb
from dcp_compile.runtime.errors import DCPTransformError
from helpers import seeded_weights

import third_party as T  # noqa: E402

if importlib.util.find_spec("x_transformers") is None:
    pytest.skip("x-transformers is not installed: run scripts/setup.sh "
                "(requirements/corpus.txt)", allow_module_level=True)

ALIBI = "x-transformers/alibi"


def _alibi_module():
    from x_transformers.x_transformers import AlibiPositionalBias
    return AlibiPositionalBias(heads=4, total_heads=8)


@pytest.mark.parametrize("queries,keys", [(1, 1), (1, 9), (7, 7), (16, 16), (3, 16)])
def test_recomputed_bias_is_the_modules_own(queries, keys):
    module = _alibi_module()
    want = module(queries, keys)
    got = mb.alibi_bias(module.slopes, module.total_heads, queries, keys)
    assert torch.equal(got, want)
    assert got[4:].abs().sum() == 0           # heads past alibi_num_heads: no bias


def test_swapped_model_computes_its_own_forward():
    model = T.build(ALIBI)
    sites = mb.bias_sites(model)
    assert [n for n, *_ in sites] == ["attn_layers.rel_pos"]
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = T.logits_of(model, ids)
        with mb.module_position_bias_enabled(sites) as swapped:
            got = T.logits_of(model, ids)
        rel_pos = model.attn_layers.rel_pos
        rel_pos.slopes.mul_(2)                    # other slopes: another model
        rel_pos.bias = None
        with mb.module_position_bias_enabled(sites):
            other = T.logits_of(model, ids)
    assert swapped == 1 and "forward" not in vars(rel_pos)      # the swap is undone
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (other - want).abs().max() > 1e-3


def test_prefill_matches_and_decode_is_refused_for_the_real_limit():
    model = T.build(ALIBI)
    out = hf_corpus.run_model(model, "prefill", logits_of=T.logits_of, check=False)
    assert out.kind == "matches", (out.cell(), out.message[:800])
    out = hf_corpus.run_model(model, "decode", logits_of=T.logits_of, check=False)
    assert out.kind == "refused" and "num_kv_heads=8." in out.message, out.message


def test_grouped_heads_with_alibi_are_refused_by_name():
    """x-transformers tiles its K/V heads; read as GQA, the query heads are permuted, which
    a per-head bias does not follow (passes/untile_kv_heads.py): a refusal naming it."""
    torch.manual_seed(0)
    model = seeded_weights(T._x_transformers(dict(alibi_pos_bias=True, alibi_num_heads=4,
                                                  attn_kv_heads=2))().float().eval(), 0)
    out = hf_corpus.run_model(model, "decode", logits_of=T.logits_of, check=False)
    assert out.kind == "refused" and "a per-head bias" in out.message, out.message


def test_other_code_than_the_pinned_code_is_refused_naming_it():
    from x_transformers.x_transformers import AlibiPositionalBias
    model = T.build(ALIBI)

    class Tweaked(AlibiPositionalBias):
        def forward(self, i, j):
            return super().forward(i, j) * 2

    model.attn_layers.rel_pos.__class__ = Tweaked
    with pytest.raises(DCPTransformError, match=r"attn_layers\.rel_pos \(.*Tweaked\) is "
                                                r"x-transformers 2\.31\.10's position bias.*"
                                                r"code differs.*AlibiPositionalBias\.forward"):
        mb.bias_sites(model)

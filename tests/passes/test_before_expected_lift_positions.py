"""lift_positions, Before/Expected: a paged step graph (after insert_paged_cache: a
``clamp_min(positions, 0)`` and an attention op over the caches) whose model still computes
positional values from ``arange(S)`` -- a learned position table's rows, a table sliced by the
length -- reads them from the step's positions instead, one row per sequence. A value that
mixes positions across tokens is refused, and so is a graph without the cache insertion."""

import pytest
import torch

from dcp_compile.passes.positions import LiftPositions
from dcp_compile.runtime.errors import DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts

from before_expected import aten, assert_code, before, call, context, node, run_alone

B, S, HIDDEN, VOCAB, ROWS = 2, 4, 8, 16, 12


def _pass(facts=None):
    ctx = context(2, 1, "context", block_size=4)
    if facts is not None:
        ctx.facts = facts
    return LiftPositions(ctx, "input_ids")


def _learned(p_embed, p_pos, p_head, input_ids, positions, block_table):
    clamped = aten.clamp_min.default(positions, 0)      # what insert_paged_cache left
    i = node(input_ids, aten.arange.default, S)
    h = aten.add.Tensor(aten.embedding.default(p_embed, input_ids),
                        aten.embedding.default(p_pos, aten.unsqueeze.default(i, 0)))
    return (aten.linear.default(h, p_head), clamped)


def _inputs(seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    return dict(p_embed=torch.randn(VOCAB, HIDDEN, generator=g),
                p_pos=torch.randn(ROWS, HIDDEN, generator=g),
                p_head=torch.randn(VOCAB, HIDDEN, generator=g),
                input_ids=torch.randint(0, VOCAB, (B, S), generator=g),
                positions=torch.tensor([[0, 1, 2, 3], [5, 6, 7, -1]]),
                block_table=torch.zeros(B, 2, dtype=torch.int64), **extra)


# The table's rows [1, S] (one for every sequence) become [B, S] rows read at the clamped
# positions: embedding of [B, 1, S], its size-1 dim dropped where the batch is.
LEARNED = """
    def forward(self, p_embed, p_pos, p_head, input_ids, positions, block_table):
        clamp_min_default = aten.clamp_min.default(positions, 0)
        embedding_default = aten.embedding.default(p_embed, input_ids)
        unsqueeze = aten.unsqueeze.default(clamp_min_default, 1)
        embedding = aten.embedding.default(p_pos, unsqueeze)
        squeeze_dim = aten.squeeze.dim(embedding, 1)
        add_tensor = aten.add.Tensor(embedding_default, squeeze_dim)
        linear_default = aten.linear.default(add_tensor, p_head)
        return (linear_default, clamp_min_default)
    """


def test_a_learned_position_table_reads_the_positions_input():
    p = _pass()
    gm = run_alone(p, before(_learned, **_inputs()))
    assert_code(gm, LEARNED)
    assert p.matched == {"sources": 1, "positional_values": 1, "position_tables": 0}


def test_each_row_reads_its_own_positions():
    """Row 1 sits at positions 5..7 (and a padding slot): it gets those rows of the table,
    not rows 0..3 as the captured arange said; padding reads row 0."""
    inputs = _inputs()
    gm = run_alone(_pass(), before(_learned, **inputs))
    logits, _ = call(gm)
    rows = inputs["positions"].clamp_min(0)
    h = inputs["p_embed"][inputs["input_ids"]] + inputs["p_pos"][rows]
    torch.testing.assert_close(logits, h @ inputs["p_head"].T, rtol=1e-6, atol=1e-6)


def _sliced(p_embed, p_cos, input_ids, positions, block_table):
    clamped = aten.clamp_min.default(positions, 0)
    cos = aten.slice.Tensor(p_cos, 0, 0, S)               # cos_cached[:S]
    h = aten.mul.Tensor(aten.embedding.default(p_embed, input_ids), cos)
    return (h, clamped)


# cos_cached[:S] is cos_cached[arange(S)], read at the positions per row: torch's batching
# rule (vmap) for index_select over a [B, S] index is a gather from the table expanded
# over the batch.
SLICED = """
    def forward(self, p_embed, p_cos, input_ids, positions, block_table):
        clamp_min_default = aten.clamp_min.default(positions, 0)
        embedding_default = aten.embedding.default(p_embed, input_ids)
        view = aten.view.default(clamp_min_default, [2, 4, 1])
        view_1 = aten.view.default(view, [2, 4, 1])
        expand = aten.expand.default(view_1, [2, 4, 8])
        expand_1 = aten.expand.default(p_cos, [2, 12, 8])
        gather = aten.gather.default(expand_1, 1, expand)
        view_default = aten.view.default(gather, [-1, 4, 8])
        mul_tensor = aten.mul.Tensor(embedding_default, view_default)
        return (mul_tensor, clamp_min_default)
    """


def test_a_table_sliced_by_the_length_is_read_at_the_positions_and_remembered():
    p = _pass()
    inputs = _inputs()
    inputs = dict(p_embed=inputs["p_embed"], p_cos=torch.randn(ROWS, HIDDEN),
                  input_ids=inputs["input_ids"], positions=inputs["positions"],
                  block_table=inputs["block_table"])
    gm = run_alone(p, before(_sliced, **inputs))
    assert_code(gm, SLICED)
    assert p.ctx.facts.position_tables == (("p_cos", 0),)      # for the one-token step
    h, _ = call(gm)
    want = inputs["p_embed"][inputs["input_ids"]] * \
        inputs["p_cos"][inputs["positions"].clamp_min(0)]
    torch.testing.assert_close(h, want, rtol=0, atol=0)


def _mixing(p_embed, p_head, input_ids, positions, block_table):
    clamped = aten.clamp_min.default(positions, 0)
    i = node(input_ids, aten.arange.default, S)
    total = aten.cumsum.default(aten.to.dtype(i, torch.float32), 0)    # over the tokens
    h = aten.add.Tensor(aten.embedding.default(p_embed, input_ids),
                        aten.unsqueeze.default(aten.unsqueeze.default(total, 0), -1))
    return (aten.linear.default(h, p_head), clamped)


def test_a_value_that_mixes_positions_across_tokens_is_refused():
    inputs = _inputs()
    del inputs["p_pos"]
    with pytest.raises(DCPTransformError, match=r"a value computed from the positions mixes "
                                                r"tokens.*node cumsum"):
        run_alone(_pass(), before(_mixing, **inputs))


def _uncached(p_embed, p_pos, p_head, input_ids, positions, block_table):
    i = node(input_ids, aten.arange.default, S)
    h = aten.add.Tensor(aten.embedding.default(p_embed, input_ids),
                        aten.embedding.default(p_pos, aten.unsqueeze.default(i, 0)))
    return (aten.linear.default(h, p_head),)


def test_a_graph_without_the_cache_insertions_clamp_is_refused():
    with pytest.raises(DCPTransformError, match=r"reads the positions through one "
                                                r"clamp_min\(positions, 0\).*Run "
                                                r"insert_paged_cache before lift_positions"):
        run_alone(_pass(), before(_uncached, **_inputs()))


def _one_token(p_embed, p_cos, input_ids, positions, block_table):
    clamped = aten.clamp_min.default(positions, 0)
    cos = aten.slice.Tensor(p_cos, 0, 0, 1)               # cos_cached[:1]: S = 1
    return (aten.mul.Tensor(aten.embedding.default(p_embed, input_ids), cos), clamped)


@pytest.mark.parametrize("known", [True, False], ids=["prompt-step-sliced-it",
                                                      "first-row-literal"])
def test_a_one_token_step_lifts_only_the_tables_its_prompt_step_sliced(known):
    """``table[:1]`` is the first row or the length's slice: the prompt step's facts say."""
    facts = ModelFacts(position_tables=(("p_cos", 0),)) if known else ModelFacts()
    p = _pass(facts)
    inputs = dict(p_embed=torch.randn(VOCAB, HIDDEN), p_cos=torch.randn(ROWS, HIDDEN),
                  input_ids=torch.tensor([[3], [5]]), positions=torch.tensor([[4], [9]]),
                  block_table=torch.zeros(B, 2, dtype=torch.int64))
    gm = run_alone(p, before(_one_token, **inputs))
    h, _ = call(gm)
    rows = inputs["positions"] if known else torch.zeros(B, 1, dtype=torch.int64)
    want = inputs["p_embed"][inputs["input_ids"]] * inputs["p_cos"][rows]
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    assert p.matched["position_tables"] == int(known)

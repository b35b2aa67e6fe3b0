"""insert_rank, Before/Expected: a 0-d int64 `tp_rank` input appears before the first step
input; nothing reads it yet, so the program computes what it did."""

import torch

from dcp_compile.passes.insert_rank import InsertRank

from before_expected import aten, assert_code, before, call, context, run_alone


def _before():
    def f(p_weight, input_ids, positions):
        h = aten.embedding.default(p_weight, input_ids)
        return aten.add.Tensor(h, aten.unsqueeze.default(positions, -1))
    torch.manual_seed(0)
    return before(f, p_weight=torch.randn(10, 4), input_ids=torch.tensor([[1, 2, 3]]),
                  positions=torch.tensor([[0, 1, 2]]))


def test_rank_input_goes_before_the_first_step_input():
    p = InsertRank(context(2, 1, "decode"), "input_ids")
    gm = run_alone(p, _before())
    assert_code(gm, """
        def forward(self, p_weight, tp_rank, input_ids, positions):
            embedding_default = aten.embedding.default(p_weight, input_ids)
            unsqueeze_default = aten.unsqueeze.default(positions, -1)
            add_tensor = aten.add.Tensor(embedding_default, unsqueeze_default)
            return add_tensor
        """)
    rank = next(n for n in gm.graph.nodes if n.name == "tp_rank")
    v = rank.meta["val"]
    assert (v.shape, v.dtype) == (torch.Size([]), torch.int64)
    assert rank.meta["dcp_kind"] == "rank" and p.inserted == {"rank": 1}


def test_same_values_on_every_rank():
    gm = run_alone(InsertRank(context(2, 1, "decode"), "input_ids"), _before())
    want = call(_before())
    for r in range(2):
        torch.testing.assert_close(call(gm, tp_rank=torch.tensor(r)), want, rtol=0, atol=0)

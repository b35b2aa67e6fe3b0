"""Add the rank as a program input: one graph serves every rank (rank is data, not code)."""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.runtime.names import RANK_INPUT

from .infra import KIND_RANK, DCPPass, Property, ensure


class InsertRank(DCPPass):
    """Insert the 0-d int64 placeholder `tp_rank` before the step inputs."""

    name = "insert_rank"
    required = frozenset({Property.PROVEN})
    ensured = frozenset({Property.RANK_INPUT})

    def __init__(self, ctx, first_user_input: str):
        super().__init__(ctx)
        self.first_user_input = first_user_input

    def call(self, gm):
        anchor = next(n for n in gm.graph.nodes
                      if n.op == "placeholder" and n.name == self.first_user_input)
        mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes
                                 if n.op == "placeholder"])
        with gm.graph.inserting_before(anchor):
            rank = gm.graph.placeholder(RANK_INPUT)
        with mode:
            rank.meta["val"] = torch.empty((), dtype=torch.int64)
        self.tag(rank, KIND_RANK)
        return PassResult(gm, True)

    def ensures(self, gm):
        ranks = [n.name for n in gm.graph.nodes if n.name == RANK_INPUT]
        ensure(len(ranks) == 1, self.name, f"not exactly one {RANK_INPUT} input", ranks)

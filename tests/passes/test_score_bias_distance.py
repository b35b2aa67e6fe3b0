"""score_bias.position_bias_of on a distance table: the bias the mask reader gives (the
table an uninterpreted ``distance_k(h, d)``, passes/mask_predicate.py) proven a function of
the key-query distance plus a per-query constant, or refused naming the site. Before: a
formula over the scores' axes (x1 head, i query, j key); expected: the table and its
coefficient, or the refusal."""

from __future__ import annotations

import pytest
import sympy
from torch.fx import Graph

from dcp_compile.passes.attention_patterns import Site
from dcp_compile.passes.mask_predicate import I, J
from dcp_compile.passes.score_bias import DistanceTable, position_bias_of
from dcp_compile.passes.symbolic_tensors import axis
from dcp_compile.runtime.errors import DCPTransformError

D = sympy.Function("distance_0")
H = axis(1)


def _site():
    g = Graph()
    bias = g.placeholder("dcp_distance_table_rel_pos_32")
    return Site(node=bias, out=bias, q=bias, k=bias, v=bias, scale=1.0, causal=True,
                bias=bias), bias


@pytest.mark.parametrize("bias,coefficient", [
    (D(H, sympy.Abs(I - J)), 1.0),                         # x-transformers' |q - k| read
    (2 * D(H, I - J) + 3 * I, 2.0),                        # scaled, plus a per-query term
    (D(H, sympy.Abs(J - I)) - D(H, 0), 1.0),               # minus the head's own constant
], ids=["abs", "scaled+per-query", "minus-constant"])
def test_a_table_of_the_distance_is_read(bias, coefficient):
    s, table = _site()
    got = position_bias_of(s, bias, {D: table})
    assert got == DistanceTable(table=table, coefficient=coefficient)


@pytest.mark.parametrize("bias,why", [
    (D(H, I), "not a bias of the key-query distance"),          # the query's own position
    (D(H, J), "not a bias of the key-query distance"),          # the key's own position
    (D(H, 2 * (I - J)), "not a bias of the key-query distance"),  # another index
    (D(H, I - J) * axis(0), "differs across batch rows"),
    (D(0, I - J) + D(H, I - J) * 0 + D(H, 1) * (I - J), "not a bias of the key-query"),
], ids=["query-pos", "key-pos", "twice-the-distance", "per-row", "linear-in-a-cell"])
def test_other_biases_are_refused_naming_the_site(bias, why):
    s, table = _site()
    with pytest.raises(DCPTransformError, match=why):
        position_bias_of(s, bias, {D: table})

"""Finite fills: a mask that hides a key with a finite number F instead of -inf
(docs/guarantees.md, "Finite fills"). The model's own softmax gives such a key the weight
exp(s + F - m) (a fill added to the score) or exp(F - m) (a fill in its place: masked_fill,
where, OpenAI-GPT's product ``scores * b + F * (1 - b)``), m the query's largest kept
score; the paged op hides it exactly. They agree where that weight rounds to 0 in the
softmax's dtype: ``underflow_margin`` is where exp does, ``fill_condition`` states it on the
mask theorem of a fill put in place of the scores (the product, masked_fill, where),
``product_keep`` reads the product's b as "keep" booleans (b must be 0 or 1 at every
position). Fills above ``MASKED_OUT`` are refused where the site is read
(``attention_patterns``)."""

from __future__ import annotations

import math

import sympy
import torch

from .attention_patterns import Site, fail
from .infra import val
from .symbolic_tensors import as_bool, pieces


def underflow_margin(dtype: torch.dtype) -> float:
    """-ln of half the smallest subnormal of ``dtype``: exp(x) rounds to exactly 0 in it for
    every x < -margin (float32 103.97, bfloat16 92.88, float16 17.33)."""
    fi = torch.finfo(dtype)
    return -math.log(fi.smallest_normal * fi.eps / 2)


def product_keep(s: Site, m):
    """b of ``scores * b + F * (1 - b)`` as "keep" booleans. Where b is 1 the score is kept
    unchanged, where 0 it is the fill F (<= MASKED_OUT, checked by the site's reader); any
    other value of b, at any position, would scale the score: refused with its value."""
    if m.boolean:
        return as_bool(m.expr, True)
    kept = []
    for value, cond in pieces(m.expr):
        if value not in (sympy.Integer(0), sympy.Integer(1)) and not (
                value.is_number and float(value) in (0.0, 1.0)):
            fail(s.mask, f"the product mask of {s.node.name} (scores * b + F * (1 - b)) takes "
                 f"the value {value} where {cond}: b must be 0 or 1 at every position (else "
                 f"it scales the scores)", "Use a 0/1 mask (a tril of ones), or -inf / "
                 "torch.finfo(dtype).min with masked_fill")
        if value != 0:
            kept.append(cond)
    return sympy.Or(*kept)


# How each mask kind puts its fill F in place of a hidden score (the theorem's words).
FILL_FORMS = {"product": "scores * mask + F * (1 - mask)", "drop": "masked_fill(mask, F)",
              "keep": "where(mask, scores, F)"}


def fill_condition(s: Site) -> str:
    """The condition under which a finite fill F in place of the hidden scores (the product
    form, masked_fill, where) equals the proven mask, appended to its theorem: a masked
    key's weight in the model's own softmax is exp(F - m), m the query's largest kept score
    (its own key is kept, so m exists); it rounds to exactly 0 in the softmax's dtype when
    m > F + underflow_margin(dtype). That is a fact of the scores' values, which no proof
    of positions decides: stated, and ``check=`` runs the model against the program."""
    dtype = val(s.node).dtype
    fill = float(torch.tensor(s.fill, dtype=dtype))
    if math.isinf(fill):          # finfo(float32).min in bfloat16: -inf, nothing to state
        return ""
    bound = fill + underflow_margin(dtype)
    return (f"; the model fills masked keys with the finite F={fill:g} "
            f"({FILL_FORMS[s.mask_kind]}), not -inf: equal to this mask where exp(F - m) "
            f"rounds to 0 in {str(dtype).removeprefix('torch.')}, i.e. for every query whose "
            f"largest kept score m > F + {underflow_margin(dtype):.2f} = {bound:.6g} (a "
            f"condition on the scores' values, stated, not proven)")

"""Validate the config against the model's real head counts, then prove the layout.

An analysis: :func:`validate_and_prove` reads the graph and returns ``(config,
certificate)``; the pass of the same name returns them (a ``Found`` result) for the later
passes and the program. An ordinary model's mask theorems (insert_paged_cache) join the
layout's certificate. The transform refuses to emit a graph without a certificate: a
broken rule raises DCPConfigError (every violation), a failed theorem raises DCPProofError
(with a counterexample).
"""

from __future__ import annotations

from dataclasses import replace

from torch.fx import GraphModule

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPProofError, DCPTransformError
from dcp_compile.runtime.program.facts import ModelFacts
from dcp_compile.runtime.names import META_CERTIFICATE

from .infra import DCPPass, Found, Property, attention_nodes, val
from .prove.certificate import Certificate


def attention_layouts(gm: GraphModule) -> tuple[int, list[tuple[int, int]], int]:
    """(q heads, the distinct (kv heads, cache head_dim) in layer order, cache block size).
    Every layer has the same q heads and block size; the KV layout may differ by layer
    (per-layer KV layouts, Gemma 4: one cache group per layout)."""
    heads, layouts, blocks = set(), [], set()
    for n in attention_nodes(gm):
        q, k, kc = val(n.args[0]), val(n.args[1]), val(n.args[3])
        heads.add(q.shape[2])
        blocks.add(kc.shape[1])
        if (k.shape[2], kc.shape[3]) not in layouts:               # cache head_dim
            layouts.append((k.shape[2], kc.shape[3]))
    if len(heads) != 1 or len(blocks) != 1:
        raise DCPTransformError(f"attention layers disagree on q heads {sorted(heads)} or "
                                f"cache block size {sorted(blocks)}: DCP needs one for every "
                                f"layer (the KV layout may differ by layer).")
    return heads.pop(), layouts, blocks.pop()


def validate_and_prove(gm: GraphModule, config: DCPConfig, facts: ModelFacts,
                       certificate: Certificate | None = None
                       ) -> tuple[DCPConfig, Certificate]:
    """The config completed with the graph's head counts (DCPConfig validates on
    construction: every violated rule, with a fix; each per-layer KV layout is validated
    too, the config keeps the first layer's) and the layout's certificate (``certificate``,
    when one was proven for this layout already, else a new proof)."""
    hq, layouts, block = attention_layouts(gm)
    if block != config.block_size:
        raise DCPTransformError(f"the KV caches' block size differs from the config: "
                                f"cache block={block}, block_size={config.block_size}. "
                                f"Build caches with block_size={config.block_size}.")
    for hkv, dim in layouts[1:]:
        config.replace(num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                       mla=facts.mla is not None)
    hkv, dim = layouts[0]
    config = config.replace(num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                            mla=facts.mla is not None)
    if certificate is None:
        from .prove.theorems import prove
        certificate = prove(config.dcp, config.interleave_size, config.block_size)
    certificate = with_mask_theorems(certificate, facts.mask_theorems or ())
    if not certificate.ok:
        raise DCPProofError(certificate)
    return config, certificate


def with_mask_theorems(certificate, theorems):
    """The layout certificate plus the model's mask theorems (insert_paged_cache proved one
    per attention layer of an ordinary model), each once."""
    have = {t.name for t in certificate.theorems}
    new = tuple(t for t in theorems if t.name not in have)
    return replace(certificate, theorems=certificate.theorems + new) if new else certificate


class ValidateAndProve(DCPPass):
    name = "validate_and_prove"
    # The whole single-device step: proven facts (mask theorems, MLA) are in by now.
    required = frozenset({Property.STATIC_SHAPES, Property.POSITIONS_LIFTED,
                          Property.CANONICAL_ATTENTION, Property.CANONICAL_MOE,
                          Property.TOKEN_WISE})
    ensured = frozenset({Property.PROVEN})

    def call(self, gm):
        config, certificate = validate_and_prove(gm, self.ctx.config, self.ctx.facts,
                                                 self.ctx.certificate)
        self.record(num_q_heads=config.num_q_heads, num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim, theorems=len(certificate.theorems))
        gm.meta[META_CERTIFICATE] = certificate
        return Found(gm, False, config=config, certificate=certificate)

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


def attention_layout(gm: GraphModule) -> tuple[int, int, int, int]:
    """(q heads, kv heads, head_dim, cache block size), the same for every layer."""
    heads = set()
    for n in attention_nodes(gm):
        q, k, kc = val(n.args[0]), val(n.args[1]), val(n.args[3])
        heads.add((q.shape[2], k.shape[2], kc.shape[3], kc.shape[1]))  # cache head_dim
    if len(heads) != 1:
        raise DCPTransformError(f"attention layers disagree on (q heads, kv heads, "
                                f"head_dim, block_size): {sorted(heads)}. DCP needs one "
                                f"layout for every layer.")
    return heads.pop()


def validate_and_prove(gm: GraphModule, config: DCPConfig, facts: ModelFacts,
                       certificate: Certificate | None = None
                       ) -> tuple[DCPConfig, Certificate]:
    """The config completed with the graph's head counts (DCPConfig validates on
    construction: every violated rule, with a fix) and the layout's certificate
    (``certificate``, when one was proven for this layout already, else a new proof)."""
    hq, hkv, dim, block = attention_layout(gm)
    if block != config.block_size:
        raise DCPTransformError(f"the KV caches' block size differs from the config: "
                                f"cache block={block}, block_size={config.block_size}. "
                                f"Build caches with block_size={config.block_size}.")
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

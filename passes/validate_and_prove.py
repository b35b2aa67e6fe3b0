"""Validate the config against the model's real head counts, then prove the layout.

An ordinary model's mask theorems (insert_paged_cache) join the layout's certificate.
The transform refuses to emit a graph without a certificate: a broken rule raises
DCPConfigError (every violation), a failed theorem raises DCPProofError (with a
counterexample).
"""

from __future__ import annotations

from dataclasses import replace

from torch.fx.passes.infra.pass_base import PassResult

from dcp_compile.runtime.errors import DCPProofError, DCPTransformError
from dcp_compile.runtime.names import META_CERTIFICATE

from .infra import DCPPass, attention_nodes, val


def with_mask_theorems(certificate, theorems):
    """The layout certificate plus the model's mask theorems (insert_paged_cache proved one
    per attention layer of an ordinary model), each once."""
    have = {t.name for t in certificate.theorems}
    new = tuple(t for t in theorems if t.name not in have)
    return replace(certificate, theorems=certificate.theorems + new) if new else certificate


class ValidateAndProve(DCPPass):
    name = "validate_and_prove"

    def call(self, gm):
        heads = set()
        for n in attention_nodes(gm):
            q, k, kc = val(n.args[0]), val(n.args[1]), val(n.args[3])
            heads.add((q.shape[2], k.shape[2], kc.shape[3], kc.shape[1]))  # cache head_dim
        if len(heads) != 1:
            raise DCPTransformError(f"attention layers disagree on (q heads, kv heads, "
                                    f"head_dim, block_size): {sorted(heads)}. DCP needs one "
                                    f"layout for every layer.")
        hq, hkv, dim, block = heads.pop()
        cfg = self.ctx.config
        if block != cfg.block_size:
            raise DCPTransformError(f"the KV caches' block size differs from the config: "
                                    f"cache block={block}, block_size={cfg.block_size}. "
                                    f"Build caches with block_size={cfg.block_size}.")
        # DCPConfig validates on construction: every violated rule, with a fix.
        cfg = cfg.replace(num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                          mla=bool(self.ctx.model_facts.get("mla")))
        self.ctx.config = cfg
        if self.ctx.certificate is None:
            from .prove.theorems import prove
            self.ctx.certificate = prove(cfg.dcp, cfg.interleave_size, cfg.block_size)
        self.ctx.certificate = with_mask_theorems(self.ctx.certificate,
                                                  self.ctx.model_facts.get("mask_theorems", ()))
        if not self.ctx.certificate.ok:
            raise DCPProofError(self.ctx.certificate)
        self.record(num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                    theorems=len(self.ctx.certificate.theorems))
        gm.meta[META_CERTIFICATE] = self.ctx.certificate
        return PassResult(gm, False)

"""The outcome of a layout proof: one ``Theorem`` per claim, gathered in a ``Certificate``.

``dcp_compile.passes.prove.theorems.prove`` returns a Certificate; the CLI prints ``format_table`` or
``to_json``, and ``raise_if_failed`` turns a failed proof into ``DCPProofError`` carrying it.
How the theorems are proven is in :mod:`dcp_compile.passes.prove.engine`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dcp_compile.runtime.errors import DCPProofError

__all__ = ["PROVEN", "FAILED", "METHOD", "Theorem", "Certificate"]

PROVEN, FAILED = "proven", "failed"

# The proof method, printed under every certificate table (dcp_compile.passes.prove.engine says why).
METHOD = ("N = k*vblock + u*(I*W) + o*I + t with integers k >= 0, 0 <= u < B/I, 0 <= o < W, "
          "0 <= t < I (slots s = k*B + u*I + t); k, u, o, t, rank symbolic; residuals "
          "reduced piecewise by floor(Q + R) = Q + n (n <= R < n+1), Mod(a, d) = "
          "a - d*floor(a/d), Max/Min/[a = b] by sign; proven when every piece's residual is 0")


@dataclass(frozen=True)
class Theorem:
    """One layout theorem for one configuration, with its outcome."""

    name: str
    statement: str
    method: str
    status: str  # "proven" | "failed"
    counterexample: dict | None = None
    cases: int = 0  # pieces of the symbolic domain the proof checked

    @property
    def proven(self) -> bool:
        return self.status == PROVEN

    def to_json(self) -> dict:
        return {"name": self.name, "statement": self.statement, "method": self.method,
                "status": self.status, "counterexample": self.counterexample,
                "cases": self.cases}


@dataclass(frozen=True)
class Certificate:
    """The outcome of ``prove`` for one (dcp, interleave_size, block_size)."""

    dcp: int
    interleave_size: int
    block_size: int
    theorems: tuple[Theorem, ...]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(t.proven for t in self.theorems)

    @property
    def vblock(self) -> int:
        return self.block_size * self.dcp

    @property
    def failed(self) -> tuple[Theorem, ...]:
        return tuple(t for t in self.theorems if not t.proven)

    def __getitem__(self, name: str) -> Theorem:
        for t in self.theorems:
            if t.name == name:
                return t
        raise KeyError(name)

    def describe(self) -> str:
        n_ok = sum(t.proven for t in self.theorems)
        return (f"dcp={self.dcp}, interleave_size={self.interleave_size}, "
                f"block_size={self.block_size} (vblock={self.vblock}): "
                f"{n_ok}/{len(self.theorems)} theorems proven")

    def raise_if_failed(self) -> "Certificate":
        """Raise DCPProofError (carrying this certificate) unless every theorem is proven."""
        if not self.ok:
            raise DCPProofError(self)
        return self

    def to_json(self) -> dict:
        return {"ok": self.ok, "dcp": self.dcp, "interleave_size": self.interleave_size,
                "block_size": self.block_size, "vblock": self.vblock,
                "seconds": round(self.seconds, 4),
                "theorems": [t.to_json() for t in self.theorems]}

    def format_table(self) -> str:
        name_w = max(len(t.name) for t in self.theorems)
        lines = [self.describe(), "",
                 f"{'theorem':<{name_w}}  {'status':<6}  {'pieces':>6}  statement",
                 f"{'-' * name_w}  ------  ------  ---------"]
        for t in self.theorems:
            lines.append(f"{t.name:<{name_w}}  {t.status:<6}  {t.cases:>6}  {t.statement}")
            if t.counterexample is not None:
                lines.append(f"{'':<{name_w}}  counterexample: "
                             f"{json.dumps(t.counterexample, default=str)}")
        lines.append("")
        lines.append(f"method: {METHOD}.")
        lines.append(f"result: {'all theorems proven' if self.ok else 'PROOF FAILED'} "
                     f"({self.seconds:.2f} s)")
        return "\n".join(lines)

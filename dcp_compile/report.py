"""CompileReport: how the compiler built a program (every pass's record, the layout's
certificate, the check's result); the compiler's record, carried by the program and never
read by the runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dcp_compile.passes.manager import PassRecord
    from dcp_compile.passes.prove.certificate import Certificate

    from .check import CheckReport


@dataclass
class CompileReport:
    history: list["PassRecord"] = field(default_factory=list)   # every pass, every step
    certificate: "Certificate | None" = None                      # the layout's proof
    check: "CheckReport | None" = None                            # transform(check=...)

    def merged(self, other: "CompileReport") -> "CompileReport":
        """Both histories (this one first); this report's certificate and check."""
        return CompileReport(self.history + other.history, self.certificate, self.check)

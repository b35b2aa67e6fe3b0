"""dcp_compile: rewrite attention models into their Decode Context Parallel (DCP) form.

Public API (see README.md): ``DCPConfig``, ``DCPConfigError``, ``topology``, ``prove``,
``compute_slot_mapping``, the layout formulas in ``dcp_compile.runtime.layout``,
``transform``.

Three layers in one namespace, lowest last: the compiler (this package's own modules) >
``dcp_compile.passes`` > ``dcp_compile.runtime``; the foundation re-exported here lives in
``dcp_compile.runtime`` (docs/architecture.md: Packages and layers).
"""

from .runtime.version import __version__  # noqa: F401  (dcp-compile --version)
from .runtime.config import DCPConfig
from .runtime.errors import (DCPCheckError, DCPCompilerBug, DCPCompressedAttentionError,
                             DCPConfigError, DCPError,
                             DCPHybridError, DCPInputError, DCPKVLayoutError,
                             DCPLengthDependentError,
                             DCPOutputContractError, DCPProofError, DCPSparseAttentionError,
                             DCPTokenMixingError, DCPTransferError, DCPTransformError,
                             DCPWorldError)
from .runtime.topology import Topology, topology

__all__ = [
    "DCPCheckError", "DCPCompilerBug", "DCPCompressedAttentionError", "DCPConfig",
    "DCPConfigError", "DCPError",
    "DCPKVLayoutError",
    "DCPHybridError", "DCPInputError", "DCPLengthDependentError", "DCPOutputContractError",
    "DCPProofError", "DCPSparseAttentionError", "DCPTokenMixingError",
    "DCPTransferError", "DCPTransformError", "DCPWorldError", "Topology", "topology",
    "prove", "compute_slot_mapping", "transform", "backend", "lower", "plan",
]


def __getattr__(name):
    # Heavier frontends load on first use so that `import dcp_compile` stays cheap.
    if name == "prove":
        from dcp_compile.passes.prove.theorems import prove
        return prove
    if name == "compute_slot_mapping":
        from dcp_compile.runtime.serving.metadata import compute_slot_mapping
        return compute_slot_mapping
    if name == "backend":  # the torch.compile backend module (callable: backend(tp=..))
        import importlib
        return importlib.import_module(".backend", __name__)
    if name == "lower":
        from .lowering import lower
        return lower
    if name == "plan":
        from .planner import plan
        return plan
    if name == "transform":
        from .driver import transform
        return transform
    raise AttributeError(f"module 'dcp_compile' has no attribute {name!r}")

"""dcp_compile: rewrite attention models into their Decode Context Parallel (DCP) form.

Public API (see README.md): ``DCPConfig``, ``DCPConfigError``, ``topology``, ``prove``,
``compute_slot_mapping``, the layout formulas in ``dcp_compile.layout``, ``transform``.
"""

from ._version import __version__
from .config import DCPConfig
from .errors import (DCPConfigError, DCPError, DCPInputError, DCPProofError,
                     DCPTransferError, DCPTransformError, DCPWorldError)
from .topology import Topology, topology

__all__ = [
    "DCPConfig", "DCPConfigError", "DCPError", "DCPInputError", "DCPProofError",
    "DCPTransferError", "DCPTransformError", "DCPWorldError", "Topology", "topology",
    "prove", "compute_slot_mapping", "transform", "backend", "lower",
]


def __getattr__(name):
    # Heavier frontends load on first use so that `import dcp_compile` stays cheap.
    if name == "prove":
        from .proofs import prove
        return prove
    if name == "compute_slot_mapping":
        from .metadata import compute_slot_mapping
        return compute_slot_mapping
    if name == "backend":  # the torch.compile backend module (callable: backend(tp=..))
        import importlib
        return importlib.import_module(".backend", __name__)
    if name == "lower":
        from .lowering import lower
        return lower
    if name == "transform":
        from .pipeline import transform
        return transform
    raise AttributeError(f"module 'dcp_compile' has no attribute {name!r}")

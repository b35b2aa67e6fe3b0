"""dcp_compile: rewrite attention models into their Decode Context Parallel (DCP) form.

Public API (see README.md): ``DCPConfig``, ``DCPConfigError``, ``topology``, ``prove``,
``compute_slot_mapping``, the layout formulas in ``runtime.layout``
(also ``dcp_compile.layout``), ``transform``.

This package is the top layer (``dcp_compile`` > ``passes`` > ``runtime``); the foundation it
re-exports lives in ``runtime`` and the proofs in ``passes`` (README: Packages and layers).
"""

import importlib
import importlib.abc
import importlib.util
import sys

from ._version import __version__  # noqa: F401  (dcp-compile --version)
from runtime.config import DCPConfig
from runtime.errors import (DCPCheckError, DCPConfigError, DCPError, DCPInputError,
                            DCPProofError, DCPTransferError, DCPTransformError, DCPWorldError)
from runtime.topology import Topology, topology

# Module paths users may have imported before these modules moved down a layer. Each old
# path resolves to the new module itself (one module object, so exception classes and the
# registered dcp ops are the same whichever path imported them), and only on first use, so
# that `import dcp_compile` stays cheap (no torch, no sympy).
OLD_MODULE_PATHS = {
    f"{__name__}.errors": "runtime.errors",    # users catch our exceptions
    f"{__name__}.ops": "runtime.ops",          # models call torch.ops.dcp.* after importing it
    f"{__name__}.config": "runtime.config",    # DCPConfig, SIZE_LIMITS
    f"{__name__}.layout": "runtime.layout",    # the layout formulas (README, DESIGN)
    f"{__name__}.proofs": "passes.proofs",     # prove, prove_config, layout_with
}


class _OldPathLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__  # the import machinery overwrites it with the alias's
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the new module ran when it was imported


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = OLD_MODULE_PATHS.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(
            fullname, _OldPathLoader(new))


sys.meta_path[:] = [f for f in sys.meta_path  # once, also after importlib.reload
                   if type(f).__qualname__ != "_OldPathFinder" or type(f).__module__ != __name__]
sys.meta_path.insert(0, _OldPathFinder())

__all__ = [
    "DCPCheckError", "DCPConfig", "DCPConfigError", "DCPError", "DCPInputError", "DCPProofError",
    "DCPTransferError", "DCPTransformError", "DCPWorldError", "Topology", "topology",
    "prove", "compute_slot_mapping", "transform", "backend", "lower",
]


def __getattr__(name):
    # Heavier frontends load on first use so that `import dcp_compile` stays cheap.
    if name == "prove":
        from passes.proofs import prove
        return prove
    if name == "compute_slot_mapping":
        from runtime.metadata import compute_slot_mapping
        return compute_slot_mapping
    if f"{__name__}.{name}" in OLD_MODULE_PATHS:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "backend":  # the torch.compile backend module (callable: backend(tp=..))
        return importlib.import_module(".backend", __name__)
    if name == "lower":
        from .lowering import lower
        return lower
    if name == "transform":
        from .pipeline import transform
        return transform
    raise AttributeError(f"module 'dcp_compile' has no attribute {name!r}")

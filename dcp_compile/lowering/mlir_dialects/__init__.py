"""Empty Python modules for the MLIR dialects torch-mlir ships without Python op classes.

The MLIR bindings look up a dialect's Python module every time they wrap an operation of it
(every op a walk over the module yields) and remember only modules that were found: with no
``torch_mlir.dialects.stablehlo``, each stablehlo op cost a failed import (36 000 per lowering
of 32 layers, ~0.5 s). stablehlo.new_context puts this package on the dialect search path
after torch_mlir.dialects, so the lookup finds one of these once and generic OpViews are used.
"""

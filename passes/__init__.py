"""Graph rewrites of dcp_compile: one module per pass, plus the pass manager and dump.

The order in which they run, per step kind, is the table ``dcp_compile.passes.pipeline.PIPELINE``.
"""

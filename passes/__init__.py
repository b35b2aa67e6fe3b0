"""Graph rewrites of dcp_compile: one module per pass, plus the pass manager and dump.

Order (see ``pipeline.passes_for``): drop_export_asserts -> check_static_shapes ->
canonicalize_attention -> validate_and_prove -> insert_rank -> shard_tensor_parallel ->
(dcp_decode | dcp_context | dcp_prefill).
"""

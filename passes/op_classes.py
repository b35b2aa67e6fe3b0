"""Op classes, defined once: every pass that decides by the kind of an op reads these sets
(two passes never keep their own, drifting copies; tests/repository/test_op_classes.py refuses a
module-level set of aten ops anywhere else). Each is named by what its ops mean; a class that
is a union of others is written as that union. Pointwise ops are found by their torch tag
(``torch.Tag.pointwise``), not listed."""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from dcp_compile.runtime.kernels import sparse_attention  # noqa: F401  (dcp.index_topk)

aten = torch.ops.aten

# Leave a value's meaning unchanged: dtype casts and copies (one tensor operand, args[0]).
CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout,
                   aten.to.device, aten.clone.default, aten.contiguous.default,
                   aten.alias.default, aten.detach.default, aten.type_as.default,
                   aten.lift_fresh_copy.default})

# The casts that always return a new tensor; the other CASTS return their input itself when
# there is nothing to convert (to, type_as, contiguous, alias, detach).
FRESH_COPIES = frozenset({aten.clone.default, aten._to_copy.default,
                          aten.lift_fresh_copy.default})

# A lifted constant's wrappers (``torch.tensor(x)`` in a forward: lift_fresh_copy, detach_).
CONSTANT_WRAPPERS = CASTS | {aten.detach_.default}

# Keep every dim where it is: the casts, and eval-mode dropout.
IDENTITY_VIEWS = CASTS | {aten.dropout.default}

# Regroup dims by a literal target shape.
RESHAPES = frozenset({aten.reshape.default, aten.view.default, aten._unsafe_view.default})
# Views whose second argument is the whole output shape (x.view(shape), x.expand(shape)).
SHAPED_VIEWS = RESHAPES | {aten.expand.default}
FLATTENS = frozenset({aten.flatten.using_ints, aten.unflatten.int})
# Ops whose arguments spell out sizes (a rewrite that changes a dim's size must rescale them).
LITERAL_SHAPES = SHAPED_VIEWS | {aten.unflatten.int}

# Add or drop a dim of size 1.
SQUEEZES = frozenset({aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                      aten.squeeze.default})
# Swap the two dims of a 2-D tensor (``x.t()``, ``x.T``): no dims argument.
MATRIX_TRANSPOSES = frozenset({aten.t.default, aten.numpy_T.default})
# Reorder dims (a transpose is a permute of two).
PERMUTES = frozenset({aten.permute.default, aten.transpose.int})
# What a weight is read through and still is that weight, cut the same way (dims mapped):
# a cast (OLMo-2's ``weight.float()``) or a transpose (a ``Conv1D`` weight stored [in, out]).
WEIGHT_VIEWS = CASTS | MATRIX_TRANSPOSES | PERMUTES
# Broadcast size-1 dims to a literal shape.
EXPANDS = frozenset({aten.expand.default, aten.expand_copy.default})
# Broadcast size-1 dims to the output's shape: a literal one, or another tensor's (expand_as).
BROADCAST_VIEWS = frozenset({aten.expand.default, aten.expand_as.default})
# Move, add or drop dims without touching values.
DIM_MOVES = SQUEEZES | PERMUTES | {aten.t.default, aten.expand.default}
# Complex views: a last dim of 2 (re, im) <-> one complex element.
COMPLEX_VIEWS = frozenset({aten.view_as_complex.default, aten.view_as_real.default})

# Take parts of a dim.
SLICES = frozenset({aten.slice.Tensor, aten.narrow.default, aten.select.int})
SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                    aten.unbind.int})
CONCATS = frozenset({aten.cat.default, aten.concat.default,   # concat, concatenate: aliases
                     aten.concatenate.default})
JOINS = CONCATS | {aten.stack.default}

# Move a linear's output columns around without arithmetic, so that running them on the
# columns' indices says which column lands where (MLA absorption reads kv_b_proj's halves so).
COLUMN_LAYOUT_OPS = CASTS | RESHAPES | {aten.transpose.int, aten.permute.default,
                                        aten.unsqueeze.default, aten.split_with_sizes.default,
                                        aten.split.Tensor, aten.slice.Tensor,
                                        aten.narrow.default, operator.getitem}

# Convolutions (x-transformers' talking heads: a 1x1 conv2d over the heads as channels).
CONVOLUTIONS = frozenset({aten.conv1d.default, aten.conv2d.default, aten.convolution.default})
# Scaled dot-product attention as torch.export keeps it (q, k, v, attn_mask, ...).
SDPA_OPS = frozenset({aten.scaled_dot_product_attention.default})

SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
LOG_SOFTMAX = frozenset({aten._log_softmax.default, aten.log_softmax.int})
MATMUL = frozenset({aten.matmul.default})
# Matmuls whose leading dims are a batch (heads as a batch dim).
BATCHED_MATMULS = MATMUL | {aten.bmm.default}
# Ops whose FLOPs are 2 * numel(output) * (last dim of the first input): the planner's count.
CONTRACTIONS = BATCHED_MATMULS | {aten.linear.default, aten.mm.default, aten.addmm.default}
LAYER_NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
# Reductions that are a sum (mean: a scaled one): over a sharded dim, an all-reduce.
SUM_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList})
# Vector norms over dims (``F.normalize``, x-transformers' RMSNorm): arguments (x, ord, dim,
# keepdim), dims one position later than the other reductions'.
VECTOR_NORMS = frozenset({aten.linalg_vector_norm.default})
REDUCTIONS = SUM_REDUCTIONS | VECTOR_NORMS | {aten.amax.default, aten.amin.default,
                                              aten.var.correction}

# Elementwise arithmetic, each op's overloads (a tensor or a Python scalar operand).
ADDS = frozenset({aten.add.Tensor, aten.add.Scalar})
SUBS = frozenset({aten.sub.Tensor, aten.sub.Scalar})
RSUBS = frozenset({aten.rsub.Tensor, aten.rsub.Scalar})
MULS = frozenset({aten.mul.Tensor, aten.mul.Scalar})
# torch.multiply: mul's alias (without torch's pointwise tag; Gemma 3n).
MULTIPLY_ALIASES = frozenset({aten.multiply.Tensor, aten.multiply.Scalar})
DIVS = frozenset({aten.div.Tensor, aten.div.Scalar})
REMAINDERS = frozenset({aten.remainder.Tensor, aten.remainder.Scalar})
# Boolean connectives: on bool tensors the bitwise, logical and operator forms agree.
ANDS = frozenset({aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default})
NOTS = frozenset({aten.bitwise_not.default, aten.logical_not.default})
ORS = frozenset({aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default})
XORS = frozenset({aten.__xor__.Tensor, aten.bitwise_xor.Tensor, aten.logical_xor.default})

# Tensors filled with one constant, whatever the shape argument's form.
FILLS_OF_ONE = frozenset({aten.ones.default, aten.new_ones.default, aten.ones_like.default})
FILLS_OF_ZERO = frozenset({aten.zeros.default, aten.new_zeros.default,
                           aten.zeros_like.default})

# Positions 0..n (or start..end by step).
ARANGES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
# Pick each element from one of two operands by a condition.
WHERES = frozenset({aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
                    aten.where.Scalar})
# Overwrite the elements where a condition holds with one value.
MASKED_FILLS = frozenset({aten.masked_fill.Scalar, aten.masked_fill.Tensor})
# Every element set to one value (the functional form of ``fill_``).
FILLS = frozenset({aten.fill.Scalar, aten.fill.Tensor})

# Writes of one value into their first argument (a tensor or a view of one), by the op that
# computes the same value out of place. (``copy_`` and in-place arithmetic are below, made
# out of place into slices only; ``index_put_`` is not made out of place: a mask written so
# stays refused.)
IN_PLACE_TWINS = {aten.fill_.Scalar: aten.fill.Scalar, aten.fill_.Tensor: aten.fill.Tensor,
                  aten.masked_fill_.Scalar: aten.masked_fill.Scalar,
                  aten.masked_fill_.Tensor: aten.masked_fill.Tensor}
WRITES_IN_PLACE = frozenset(IN_PLACE_TWINS)
# Writes of a computed value into their first argument, made out of place only where they
# write through a slice or select of a tensor the graph makes (Gemma 3n's AltUp:
# ``corrected[1:] += x``, kept by torch.export as ``add_`` into a slice and a ``copy_`` of the
# sum back into it): the arithmetic ones by their out-of-place twin; ``copy_`` by its source.
ARITHMETIC_IN_PLACE_TWINS = {aten.add_.Tensor: aten.add.Tensor,
                             aten.add_.Scalar: aten.add.Scalar,
                             aten.sub_.Tensor: aten.sub.Tensor,
                             aten.sub_.Scalar: aten.sub.Scalar,
                             aten.mul_.Tensor: aten.mul.Tensor,
                             aten.mul_.Scalar: aten.mul.Scalar,
                             aten.div_.Tensor: aten.div.Tensor,
                             aten.div_.Scalar: aten.div.Scalar}
COPIES_IN_PLACE = frozenset({aten.copy_.default})
WRITES_INTO_SLICES = frozenset(ARITHMETIC_IN_PLACE_TWINS) | COPIES_IN_PLACE
# Tensors allocated without a value (MLA's key: ``new_empty``, then ``copy_`` into its
# slices, which absorb_latent_attention reads as a cat).
UNINITIALISED = frozenset({aten.empty.memory_format, aten.empty_like.default,
                           aten.new_empty.default})
# A view that cuts part of a tensor, by the op that writes a value back into that part
# (same arguments, the part's new value second).
SCATTER_OF_VIEW = {aten.slice.Tensor: aten.slice_scatter.default,
                   aten.select.int: aten.select_scatter.default}
# A value written into a slice / select of a tensor (an in-place write made a value).
VIEW_SCATTERS = frozenset(SCATTER_OF_VIEW.values())

# Top-k selections (a router's choice of experts).
# A top-k selection: torch.topk, or a DSA indexer captured as one op
# (dcp_compile/frontends/module_sparse_attention.py).
TOP_K = frozenset({aten.topk.default, torch.ops.dcp.index_topk.default})

# torch.export's runtime checks of a tensor's metadata: no-ops in a captured graph.
EXPORT_ASSERTS = frozenset({aten._assert_tensor_metadata.default})
# torch.export keeps a `with torch.autocast(...)` block as this higher-order op over a
# subgraph: (device_type, dtype, enabled, cache_enabled, subgraph, *operands).
AUTOCAST_REGIONS = frozenset({torch.ops.higher_order.wrap_with_autocast})

# An extremum of a whole tensor or of dims: its value lies in its input's range.
EXTREMA = frozenset({aten.max.default, aten.amax.default, aten.min.default, aten.amin.default})
# Comparisons, by the relation they test (tensor or scalar right operand).
GREATER = frozenset({aten.gt.Scalar, aten.gt.Tensor})
GREATER_EQUAL = frozenset({aten.ge.Scalar, aten.ge.Tensor})
LESS = frozenset({aten.lt.Scalar, aten.lt.Tensor})
LESS_EQUAL = frozenset({aten.le.Scalar, aten.le.Tensor})
# A where of two tensors (the form a decision between two computed branches takes).
TENSOR_WHERES = frozenset({aten.where.self})
# Pads of a tensor's borders.
PADS = frozenset({aten.constant_pad_nd.default, aten.pad.default})
# Ops that return (values, indices) along a dim.
VALUES_AND_INDICES = frozenset({aten.topk.default, aten.sort.default, aten.max.dim,
                                aten.min.dim})
# Rows looked up by index tensors.
LOOKUPS = frozenset({aten.gather.default, aten.index.Tensor})
# Elementwise ops torch does not tag pointwise.
UNTAGGED_ELEMENTWISE = frozenset({aten.polar.default, aten.complex.default,
                                  # `//` on integer tensors (LongCat-Flash's zero experts)
                                  aten.floor_divide.default, aten.floor_divide.Scalar})
SCATTERS = frozenset({aten.scatter.value, aten.scatter.src, aten.scatter_add.default})
# Tensors made from another's shape only (no data of it).
SHAPE_ONLY_FILLS = frozenset({aten.ones_like.default, aten.zeros_like.default,
                              aten.empty_like.default, aten.full_like.default,
                              aten.new_ones.default, aten.new_zeros.default,
                              aten.new_empty.default, aten.new_full.default})

# Recurrent mixers (runtime/kernels/recurrent.py; docs/hybrid.md): each needs its rows' whole
# sequence in order, with the state carried in a cache between steps.
import dcp_compile.runtime.kernels.recurrent  # noqa: E402,F401  (registers torch.ops.dcp.*)
RECURRENT_OPS = frozenset({torch.ops.dcp.gated_delta_net.default,
                           torch.ops.dcp.mamba2_ssm.default,
                           torch.ops.dcp.short_conv.default,
                           torch.ops.dcp.mamba_ssm.default,
                           torch.ops.dcp.kimi_delta_attention.default,
                           torch.ops.dcp.lightning_attention.default,
                           torch.ops.dcp.rg_lru.default})


def is_call(n, targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def skip_casts(n: Node) -> Node:
    while is_call(n, CASTS):
        n = n.args[0]
    return n

"""DCPConfig: one validated description of a DCP layout (spec: Constraints, Decode Constraints)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dcp_compile.runtime.errors import DCPConfigError
from dcp_compile.runtime.garbage_block import check_garbage_block
from dcp_compile.runtime.names import Mode

MODES = tuple(Mode)
KV_ROLES = (None, "kv_producer", "kv_consumer")
# Decode combine of the partial outputs (passes/dcp_decode.py): LSE all-gather + reduce-scatter,
# or one all-to-all of outputs and LSEs merged locally; and the partial outputs' wire dtype
# ("model": the model's dtype; the LSE always travels as float32).
COMBINES = ("all_gather", "all_to_all")
COMBINE_DTYPES = ("float32", "model")

# Largest accepted value of each size: far above any deployment, and small enough that every
# rule below (divisor lists, suggested fixes) and every group table stays cheap.
SIZE_LIMITS = {"tp": 2**16, "dcp": 2**16, "block_size": 2**20, "interleave_size": 2**20,
               "num_q_heads": 2**16, "num_kv_heads": 2**16, "head_dim": 2**16}


@dataclass(frozen=True)
class DCPConfig:
    """A tensor-parallel + decode-context-parallel layout for one engine.

    Head counts may be left ``None`` when only the KV layout matters (proofs, slot mapping);
    ``transform`` fills them from the model and validates again.
    """

    tp: int
    dcp: int
    mode: str = Mode.DECODE
    block_size: int = 16
    interleave_size: int | None = None
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kv_role: str | None = None
    attention_dp: bool = False
    combine: str = "all_gather"
    combine_dtype: str = "float32"
    # Multi-head Latent Attention: one latent "KV head" ([latent ; k_pe] per token) shared by
    # every query head; decode DCP shards its tokens (passes/absorb_latent_attention.py).
    mla: bool = False
    # Mixture of experts: experts partitioned over the tp ranks (expert parallel) instead of
    # each expert's intermediate dim cut over them (tensor parallel, the default).
    expert_parallel: bool = False
    # Which cache block is the garbage block (runtime/garbage_block.py): -1 the last (the
    # project's engine), 0 the first (vLLM's null block).
    garbage_block: int = -1

    def __post_init__(self):
        if self.interleave_size is None and _is_positive_int(self.block_size):
            object.__setattr__(self, "interleave_size", self.block_size)
        # Prefill DCP is the producer side of disaggregated inference (spec: Constraints).
        if self.mode == Mode.PREFILL and _is_positive_int(self.dcp) and self.dcp > 1 \
                and self.kv_role is None:
            object.__setattr__(self, "kv_role", "kv_producer")
        violations = _violations(self)
        if violations:
            raise DCPConfigError(violations)

    # Derived sizes, named as in the specification.
    @property
    def vblock(self) -> int:
        return self.block_size * self.dcp

    @property
    def stride(self) -> int:
        return self.interleave_size * self.dcp

    @property
    def dcp_tp_size(self) -> int:
        """Prefill: size of dcp_tp_group (TP / DCP), over which QKV and O are sharded."""
        return self.tp // self.dcp

    @property
    def attention_shard(self) -> int:
        """How many ways the attention weights (QKV/O heads) are split."""
        return self.tp if self.mode == Mode.DECODE else self.dcp_tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads a rank holds; 1 when TP replicates each KV head across several ranks."""
        return self.kv_heads_per_layout(self.num_kv_heads)

    def kv_heads_per_layout(self, num_kv_heads: int) -> int:
        """KV heads a rank holds of a layer with ``num_kv_heads`` (per-layer KV layouts)."""
        return max(1, num_kv_heads // self.attention_shard)

    def replace(self, **changes) -> "DCPConfig":
        return dataclasses.replace(self, **changes)

    def layout_kwargs(self) -> dict:
        """Keyword arguments of the :mod:`dcp_compile.runtime.layout` formulas."""
        return dict(dcp=self.dcp, interleave=self.interleave_size, block=self.block_size)


def _is_positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _violations(c: DCPConfig) -> list[str]:
    out: list[str] = []
    sizes = {"tp": c.tp, "dcp": c.dcp, "block_size": c.block_size,
             "interleave_size": c.interleave_size}
    for name in ("num_q_heads", "num_kv_heads", "head_dim"):
        if getattr(c, name) is not None:
            sizes[name] = getattr(c, name)
    bad = [n for n, v in sizes.items() if not _is_positive_int(v)]
    for n in bad:
        out.append(f"{n} must be a positive integer: {n}={sizes[n]!r}. Pass an int >= 1.")
    for n, v in sizes.items():
        if n not in bad and v > SIZE_LIMITS[n]:
            bad.append(n)
            out.append(f"{n} is too large: {n}={v}. Use {n} <= {SIZE_LIMITS[n]}.")
    if not isinstance(c.attention_dp, bool):
        out.append(f"attention_dp must be a bool: attention_dp={c.attention_dp!r}. "
                   "Pass True or False.")
    if c.mode not in MODES:
        out.append(f"mode must be one of {MODES}: mode={c.mode!r}. "
                   "Use mode='decode' or mode='prefill'.")
    if c.kv_role not in KV_ROLES:
        out.append(f"kv_role must be one of {KV_ROLES}: kv_role={c.kv_role!r}. "
                   "Use None, 'kv_producer' or 'kv_consumer'.")
    out.extend(_combine_violations(c))
    try:
        check_garbage_block(c.garbage_block)
    except DCPConfigError as e:
        out.extend(e.violations)
    if bad or out:
        return out  # the rules below need well-formed sizes

    tp, dcp, B, I = c.tp, c.dcp, c.block_size, c.interleave_size
    if B < I or B % I:
        out.append(f"block_size must be a multiple of interleave_size (a block holds whole "
                   f"interleave runs): block_size={B}, interleave_size={I}. "
                   f"Use interleave_size in {_divisors(B)}.")
    if tp % dcp:
        out.append(f"TP % DCP == 0: tp={tp}, dcp={dcp}. Use dcp in {_divisors(tp)}.")
    if c.attention_dp and dcp > 1:
        out.append(f"DCP cannot currently be combined with attention DP: attention_dp=True, "
                   f"dcp={dcp}. Set attention_dp=False, or dcp=1.")
    if c.kv_role is not None and I != B:
        out.append(f"cp_kv_cache_interleave_size must equal block_size for DI compatibility: "
                   f"kv_role={c.kv_role!r}, interleave_size={I}, block_size={B}. "
                   f"Use interleave_size={B}.")
    if c.mode == Mode.PREFILL and dcp > 1 and c.kv_role != "kv_producer":
        out.append(f"apply_prefill_dcp requires DI (kv_role=kv_producer) and DCP > 1: "
                   f"mode='prefill', dcp={dcp}, kv_role={c.kv_role!r}. "
                   f"Use kv_role='kv_producer' (or leave it None), or dcp=1.")
    out.extend(_head_violations(c))
    return out


def _combine_violations(c: DCPConfig) -> list[str]:
    out = []
    for name, allowed in (("combine", COMBINES), ("combine_dtype", COMBINE_DTYPES)):
        if getattr(c, name) not in allowed:
            out.append(f"{name} must be one of {allowed}: {name}={getattr(c, name)!r}. "
                       f"Use {name}={allowed[0]!r} (the default) or {allowed[1]!r}.")
    if not out and c.mode != Mode.DECODE and (c.combine, c.combine_dtype) != (
            COMBINES[0], COMBINE_DTYPES[0]):
        out.append(f"combine and combine_dtype choose the decode combine only: mode={c.mode!r}, "
                   f"combine={c.combine!r}, combine_dtype={c.combine_dtype!r}. Leave them at "
                   f"their defaults for mode={c.mode!r}.")
    return out


def _head_violations(c: DCPConfig) -> list[str]:
    """Head rules; the KV-head ones apply as soon as num_kv_heads is known (a topology, a
    transfer plan), the query-head ones once num_q_heads is known too."""
    out: list[str] = []
    hq, hkv, tp, dcp = c.num_q_heads, c.num_kv_heads, c.tp, c.dcp
    if c.mla:
        return _mla_violations(c)
    if hkv is None or tp % dcp:
        return out
    if hq is not None and hq % hkv:
        out.append(f"num_q_heads must be a multiple of num_kv_heads (GQA groups): "
                   f"num_q_heads={hq}, num_kv_heads={hkv}. Check the model config.")
        return out
    shard = c.attention_shard
    where = "full TP" if c.mode == Mode.DECODE else "dcp_tp_group (TP/DCP)"
    if hq is not None and hq % shard:
        out.append(f"query heads must split evenly over {where}: num_q_heads={hq}, "
                   f"shard={shard} (tp={tp}, dcp={dcp}). Use a tp that divides {hq}.")
    if hkv % shard and shard % hkv:
        out.append(f"KV heads must split over, or replicate evenly across, {where}: "
                   f"num_kv_heads={hkv}, shard={shard}. Use a shard size that divides "
                   f"or is a multiple of {hkv}.")
    if c.mode != Mode.DECODE or dcp == 1:
        return out
    fix = _largest_valid_decode_dcp(c)
    fix_text = f"Use dcp={fix}" if fix > 1 else "Use dcp=1"
    if not tp > hkv and hq == hkv:
        # MHA: query heads split over tp too (tp <= num_q_heads), so no tp replicates KV.
        out.append(f"decode DCP needs tp > num_kv_heads (KV must be replicated across the DCP "
                   f"group), and multi-head attention has as many KV heads as query heads, "
                   f"which split over tp: tp={tp}, num_q_heads={hq}, num_kv_heads={hkv}. "
                   f"Use dcp=1 (decode DCP needs grouped-query attention).")
        return out
    if not tp > hkv:
        out.append(f"decode DCP needs tp > num_kv_heads (KV must be replicated across the DCP "
                   f"group): tp={tp}, num_kv_heads={hkv}. Use tp={2 * hkv} or more, or dcp=1.")
        return out
    if dcp > tp // hkv:
        out.append(f"dcp <= tp // num_kv_heads: dcp={dcp}, tp={tp}, num_kv_heads={hkv}. "
                   f"{fix_text}.")
    if hq is not None and (hq // hkv) % dcp:
        out.append(f"(num_q_heads // num_kv_heads) % dcp == 0: num_q_heads={hq}, "
                   f"num_kv_heads={hkv}, dcp={dcp}. {fix_text}.")
    if (tp // hkv) % dcp:
        out.append(f"a DCP replica set must share one KV head ((tp // num_kv_heads) % dcp == 0): "
                   f"tp={tp}, num_kv_heads={hkv}, dcp={dcp}. {fix_text}.")
    return out


def _mla_violations(c: DCPConfig) -> list[str]:
    """MLA: one latent head replicated on every rank, so any tp works and decode DCP only
    needs dcp to divide tp (hence dcp <= tp; the generic TP % DCP rule says so); query heads
    split over the attention shard."""
    out: list[str] = []
    hq, hkv, tp, dcp = c.num_q_heads, c.num_kv_heads, c.tp, c.dcp
    if hkv not in (None, 1):
        out.append(f"MLA caches one latent KV head per token: num_kv_heads={hkv}. "
                   f"Pass num_kv_heads=1 (or None) with mla=True.")
    if hq is not None and not tp % dcp and hq % c.attention_shard:
        out.append(f"MLA query heads must split evenly over {c.attention_shard} ranks: "
                   f"num_q_heads={hq}, tp={tp}, dcp={dcp}. Use a tp that divides {hq}.")
    return out


def _largest_valid_decode_dcp(c: DCPConfig) -> int:
    hq, hkv, tp = c.num_q_heads, c.num_kv_heads, c.tp
    for d in reversed(_divisors(tp)):
        if (d > 1 and tp > hkv and d <= tp // hkv and (tp // hkv) % d == 0
                and (hq is None or (hq // hkv) % d == 0)):
            return d
    return 1


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order, in O(sqrt(n)) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def layout_config(dcp, interleave_size, block_size) -> DCPConfig:
    """The DCPConfig of a bare KV layout (tp = dcp); DCPConfigError names only these sizes."""
    try:
        return DCPConfig(tp=dcp, dcp=dcp, block_size=block_size,
                         interleave_size=interleave_size)
    except DCPConfigError as e:
        # tp is a stand-in here: its copy of dcp's complaint would only confuse.
        raise DCPConfigError([v for v in e.violations if not v.startswith("tp ")]
                             or e.violations) from None

"""Which prefill rank sends which KV to which decode rank (spec: "Disaggregated Inference (NIXL
Transfer)": Transfer Topologies, Head Splitting / Merging, Remote Rank Computation).

Pure planning, no I/O. Given the prefill engine's and the decode engine's :class:`DCPConfig`
(tp, dcp, num_kv_heads, block_size, interleave_size), :func:`plan_transfer` computes for every
decode rank

* the prefill ranks it reads from (``remote_ranks``, ascending) and their cp_ranks,
* per remote rank, which KV heads move and where they sit in a cache row on either side
  (``remote_head_offset`` for splitting, ``local_head_offset`` for merging, ``num_heads``),

and, for one request (sequence length + the block table of each engine),
:meth:`TransferPlan.chunks` says which token positions move: rows of
``(position, remote_block, remote_offset, local_block, local_offset, length)``, each a run of
``length`` consecutive positions that is contiguous in both caches. Ownership and local slots
come from :mod:`dcp_compile.runtime.layout` (``owner``, ``local_slot``); nothing is re-derived here.

Cache layout (both engines): per layer a key and a value tensor
``[num_blocks, block_size, kv_heads_per_rank, head_dim]``; row ``block * block_size + offset``
holds one token's heads, so a head range inside a row is contiguous but strided across rows.

The four topologies of the specification
-----------------------------------------
With ``interleave_size == block_size`` (the spec's DI requirement) global block ``j`` of
``block_size`` tokens lives on prefill cp_rank ``j % P_DCP`` and decode cp_rank ``j % D_DCP``:

* DCP prefill -> standard decode: each decode rank reads all P_DCP cp_ranks of its heads,
  local blocks interleaved by token group (local block ``P_DCP*m + c`` <- remote block ``m``).
* same DCP degree: decode dcp_rank r reads prefill cp_rank r, block ``m`` -> block ``m``.
* P_DCP > D_DCP (P_DCP % D_DCP == 0): decode dcp_rank r reads cp_ranks {r, r+D_DCP, ...}.
* standard prefill -> DCP decode: decode dcp_rank r keeps remote blocks ``D_DCP*m + r``.

Beyond the spec, any pair of DCP degrees: since every interleave run is one whole block on
both sides, decode cp_rank r reads the blocks it shares with prefill cp_rank c, and they
share some exactly when ``c = r (mod gcd(P_DCP, D_DCP))`` -- the four cases above are
``gcd = D_DCP`` and ``gcd = 1``; e.g. P_DCP=2 -> D_DCP=4: decode cp_rank r reads cp_rank
``r % 2``, keeping its remote blocks ``2m + r // 2``. Every such pair is planned.

Anything else (KV heads that neither divide nor replicate evenly, decode DCP groups that do
not share their KV heads, different block sizes, an interleave other than the block size) is
rejected with :class:`DCPTransferError` before any transfer.

What we found: the spec's remote-rank formula vs its worked examples
--------------------------------------------------------------------
:func:`spec_remote_ranks` transcribes the formula literally. Against the spec's own examples
(num_kv_heads=8, the largest count the decode constraints allow for D:TP=16/DCP=2) and the
brute-force coverage test (tests/transfer/test_transfer_plan.py):

1. ``P:TP=4/DCP=2 -> D:TP=2``: formula and example agree ([0, 2], [1, 3]).
2. ``P:TP=32/DCP=2 -> D:TP=16/DCP=2``: the formula gives decode rank 1 -> [17], the example
   [16]. Both hold KV head 0 at cp_rank 1 (prefill replicates each head on 2 ranks), so the
   data is the same; the formula picks by decode rank, the example the first replica.
3. ``P:TP=32/DCP=4 -> D:TP=16/DCP=2``: the formula gives [0] and [17]; the example
   [0, 16] and [8, 24]. The formula is wrong here: ``num_target_ranks = tp_ratio * head_ratio``
   (= 2) ignores that the decode engine replicates KV heads (D_TP > num_kv_heads), so it
   enumerates too few cp_ranks, and the DCP filter then keeps one of them; rank 17 is
   cp_rank 2 holding head 1, while decode rank 1 needs head 0 from cp_ranks 1 and 3.
4. ``P:TP=16 -> D:TP=16/DCP=2``: the formula gives [0] and [] -- the DCP filter drops decode
   rank 1's only remote rank. The example (and the prose: "keeps even/odd-indexed remote
   blocks") filter *blocks*, not ranks, when the prefill has no DCP.

Beyond the examples: over the 357 topologies of the brute-force enumeration (P_TP <= 8,
D_TP <= 16, num_kv_heads in 1..8, every DCP degree) that the spec's own rules serve (P_DCP
a multiple of D_DCP, or 1) the formula names a correct
set of ranks for 90 (80 equal to this plan, 10 other replicas of the same data); it is
undefined for 189 (P_TP < D_TP: ``tp_ratio = 0``, ``num_target_ranks = 0``, division by
zero), misses KV for 62 (the decode engine replicates KV heads, or the prefill has no DCP
while the decode has) and reads some KV twice for 16 (a standard prefill replicating heads:
it lists several ranks that hold the same data). The brute-force check decides, so the plan
is built from what each rank holds instead:

* prefill cp_ranks read by decode cp_rank r: all of ``range(P_DCP)`` filtered by
  ``c % g == r % g``, ``g = gcd(P_DCP, D_DCP)`` (the spec's ``c % D_DCP == r`` applied to
  cp_ranks when D_DCP divides P_DCP, ordered cp-major as the formula's list is when it is
  right; the single cp_rank 0 when P_DCP == 1);
* per KV head the decode rank holds and per such cp_rank, the prefill ranks of that cp_rank
  holding the head (``Topology.kv_heads_of``); when several replicas hold it, the decode
  ranks that want the same (head, cp_rank) are spread round-robin over the replicas. That
  reproduces all four examples (ties: ex. 2 picks 16, the first replica, because decode
  rank 1 is the only rank wanting head 0 from cp_rank 1), and the formula wherever the
  formula is right (e.g. ex. 4 before its filter: decode rank d <- prefill rank d).

Split / merge / match is decided by heads per rank (remote_block_len vs local_block_len at
the same block size), as in the spec's table.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import torch

from dcp_compile.runtime import layout
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPConfigError, DCPTransferError
from dcp_compile.runtime.topology import Topology, topology

__all__ = [
    "CHUNK_COLUMNS",
    "HeadRead",
    "DecodeRankPlan",
    "TransferPlan",
    "engine_configs",
    "plan_transfer",
    "spec_remote_ranks",
    "table_entries",
    "transfer_violations",
]

# Columns of TransferPlan.chunks(): one run of `length` consecutive global positions starting
# at `position`, contiguous in the remote (prefill) cache and in the local (decode) cache.
CHUNK_COLUMNS = ("position", "remote_block", "remote_offset", "local_block", "local_offset",
                 "length")


@dataclass(frozen=True)
class HeadRead:
    """What one decode rank takes from one prefill rank: ``num_heads`` KV heads.

    ``remote_head_offset`` is where the first of them sits in the remote cache row (splitting:
    the prefill rank holds more heads than the decode rank); ``local_head_offset`` where it
    goes in the local row (merging: the decode rank assembles its heads from several remotes).
    """

    remote_rank: int
    remote_cp_rank: int
    heads: tuple[int, ...]
    remote_head_offset: int
    local_head_offset: int

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def to_json(self) -> dict:
        return {"remote_rank": self.remote_rank, "remote_cp_rank": self.remote_cp_rank,
                "heads": list(self.heads), "remote_head_offset": self.remote_head_offset,
                "local_head_offset": self.local_head_offset, "num_heads": self.num_heads}


@dataclass(frozen=True)
class DecodeRankPlan:
    """Everything decode rank ``rank`` reads, sorted by remote rank."""

    rank: int
    cp_rank: int
    kv_heads: tuple[int, ...]
    reads: tuple[HeadRead, ...]

    @property
    def remote_ranks(self) -> list[int]:
        return sorted({r.remote_rank for r in self.reads})

    @property
    def remote_cp_ranks(self) -> list[int]:
        return sorted({r.remote_cp_rank for r in self.reads})


@dataclass(frozen=True)
class TransferPlan:
    """The rank-level plan for one (prefill engine, decode engine) pair; see the module doc."""

    prefill: DCPConfig
    decode: DCPConfig
    kind: str  # "match" | "split" | "merge" (spec: Head Splitting / Merging)
    ranks: tuple[DecodeRankPlan, ...]

    # ------------------------------------------------------------------ rank level
    def rank(self, decode_rank: int) -> DecodeRankPlan:
        if not (isinstance(decode_rank, int) and 0 <= decode_rank < self.decode.tp):
            raise DCPTransferError(f"decode rank out of range: rank={decode_rank!r}, decode "
                                   f"tp={self.decode.tp}. Use 0 <= rank < {self.decode.tp}.")
        return self.ranks[decode_rank]

    @property
    def decode_block_groups(self) -> int:
        """A decode rank reads every ``P_DCP / gcd(P_DCP, D_DCP)``-th entry of its block table
        from one prefill cp_rank: allocating a request's entries grouped by that residue
        (``BlockAllocator.ensure(..., groups=)``) makes the rows it writes one run."""
        return self.prefill.dcp // gcd(self.prefill.dcp, self.decode.dcp)

    @property
    def prefill_block_groups(self) -> int:
        """The same on the prefill side: a decode cp_rank reads every ``D_DCP / gcd(P_DCP,
        D_DCP)``-th entry of the prefill block table (e.g. a standard prefill -> DCP decode)."""
        return self.decode.dcp // gcd(self.prefill.dcp, self.decode.dcp)

    def readers_of(self, prefill_rank: int) -> list[int]:
        """Decode ranks whose plan names ``prefill_rank`` (each notifies it once per request)."""
        return [p.rank for p in self.ranks if prefill_rank in p.remote_ranks]

    # ------------------------------------------------------------------ request level
    def chunks(self, decode_rank: int, remote_cp_rank: int, seq_len: int,
               prefill_block_table, decode_block_table) -> torch.Tensor:
        """Runs that decode rank ``decode_rank`` reads from prefill cp_rank ``remote_cp_rank``.

        Returns an int64 tensor ``[n, 6]`` with columns :data:`CHUNK_COLUMNS`. Block tables
        hold one entry per vblock (``block_size * dcp`` global positions), the same table on
        every rank of an engine; the blocks are physical block indices of the cache tensors.
        Every position < ``seq_len`` the decode rank owns appears in exactly one chunk of
        exactly one of its remote cp_ranks.
        """
        p, d = self.prefill, self.decode
        cp_d = self.rank(decode_rank).cp_rank
        if not 0 <= remote_cp_rank < p.dcp:
            raise DCPTransferError(f"remote cp_rank out of range: cp_rank={remote_cp_rank}, "
                                   f"prefill dcp={p.dcp}. Use 0 <= cp_rank < {p.dcp}.")
        if not isinstance(seq_len, int) or seq_len < 0:
            raise DCPTransferError(f"sequence length must be an int >= 0: seq_len={seq_len!r}. "
                                   "Pass the number of prefilled tokens.")
        p_table = _block_table(prefill_block_table, seq_len, p, "prefill")
        d_table = _block_table(decode_block_table, seq_len, d, "decode")
        pkw, dkw = p.layout_kwargs(), d.layout_kwargs()
        # A run of `step` aligned positions has one owner and consecutive local slots inside one
        # block on both sides (interleave runs on a DCP side, whole blocks on a standard one).
        step = gcd(_run_length(p), _run_length(d))
        start = torch.arange(0, seq_len, step, dtype=torch.int64)
        keep = ((layout.owner(start, **pkw) == remote_cp_rank)
                & (layout.owner(start, **dkw) == cp_d))
        start = start[keep]
        length = layout.clamp(seq_len - start, hi=step)
        r_slot = layout.local_slot(start, **pkw)
        l_slot = layout.local_slot(start, **dkw)
        r_block = p_table[r_slot // p.block_size]
        l_block = d_table[l_slot // d.block_size]
        return torch.stack([start, r_block, r_slot % p.block_size,
                            l_block, l_slot % d.block_size, length], dim=1)

    def block_pattern(self, decode_rank: int, remote_cp_rank: int) -> dict:
        """The block mapping of one (decode rank, remote cp_rank) pair as an affine pattern.

        Computed from :meth:`chunks` over four periods with identity block tables, so it says
        which block-table entry ``m``-th remote block maps to which local entry, e.g.
        ``local 2m+1 <- remote m`` (a decode rank interleaving two prefill cp_ranks).
        """
        p, d = self.prefill, self.decode
        period = _lcm(p.vblock, d.vblock)
        n = 4 * period
        ident_p = list(range(table_entries(n, p)))
        ident_d = list(range(table_entries(n, d)))
        c = self.chunks(decode_rank, remote_cp_rank, n, ident_p, ident_d)
        out = {"tokens_per_chunk": int(c[0, 5]) if len(c) else 0}
        rb, lb = c[:, 1].tolist(), c[:, 3].tolist()
        whole = bool(len(c)) and all(x == 0 for x in c[:, 2].tolist() + c[:, 4].tolist()) \
            and out["tokens_per_chunk"] == p.block_size
        fit_r, fit_l = _affine_fit(rb), _affine_fit(lb)
        if whole and fit_r and fit_l:
            out["remote_block"], out["local_block"] = list(fit_r), list(fit_l)
            out["text"] = f"local {_affine_text(*fit_l)} <- remote {_affine_text(*fit_r)}"
        else:  # not whole blocks: list the first runs of one period
            out["runs"] = [dict(zip(CHUNK_COLUMNS, row)) for row in c[:8].tolist()]
            out["text"] = "runs: " + ", ".join(
                f"r{b}[{o}:{o + n_}]->l{b2}[{o2}:{o2 + n_}]"
                for _, b, o, b2, o2, n_ in c[:4].tolist())
        return out

    # ------------------------------------------------------------------ presentation
    def to_json(self) -> dict:
        ranks = []
        for rp in self.ranks:
            spec = spec_remote_ranks(self.prefill, self.decode, rp.rank)
            ranks.append({
                "rank": rp.rank, "cp_rank": rp.cp_rank, "kv_heads": list(rp.kv_heads),
                "remote_ranks": rp.remote_ranks, "remote_cp_ranks": rp.remote_cp_ranks,
                "reads": [dict(r.to_json(),
                               block_pattern=self.block_pattern(rp.rank, r.remote_cp_rank))
                          for r in rp.reads],
                "spec_formula_remote_ranks": spec,
            })
        return {"prefill": _engine_json(self.prefill), "decode": _engine_json(self.decode),
                "kind": self.kind, "spec_quantities": spec_quantities(self.prefill, self.decode),
                "decode_ranks": ranks}

    def format_table(self) -> str:
        p, d = self.prefill, self.decode
        q = spec_quantities(p, d)
        lines = [f"transfer plan: prefill TP={p.tp}/DCP={p.dcp} -> decode TP={d.tp}/DCP={d.dcp}"
                 f", num_kv_heads={p.num_kv_heads}, block_size={p.block_size}",
                 f"  {self.kind}: {_heads_per_rank(p)} KV head(s) per prefill rank, "
                 f"{_heads_per_rank(d)} per decode rank; spec: tp_ratio={q['tp_ratio']}, "
                 f"head_ratio={q['head_ratio']}, num_target_ranks={q['num_target_ranks']}"]
        for rp in self.ranks:
            spec = spec_remote_ranks(p, d, rp.rank)
            same = spec is not None and sorted(spec) == rp.remote_ranks
            note = "" if same else f"   (spec formula: {spec})"
            lines.append(f"  decode rank {rp.rank} (cp_rank {rp.cp_rank}, heads "
                         f"{list(rp.kv_heads)}) <- prefill ranks {rp.remote_ranks}{note}")
            for r in rp.reads:
                pat = self.block_pattern(rp.rank, r.remote_cp_rank)
                lines.append(f"      rank {r.remote_rank:<3} (cp_rank {r.remote_cp_rank}): heads "
                             f"{list(r.heads)}, remote head offset {r.remote_head_offset}, "
                             f"local head offset {r.local_head_offset}; {pat['text']}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Building the plan
# ---------------------------------------------------------------------------------------


def engine_configs(*, prefill_tp: int, prefill_dcp: int, decode_tp: int, decode_dcp: int,
                   num_kv_heads: int, block_size: int = 16,
                   interleave_size: int | None = None) -> tuple[DCPConfig, DCPConfig]:
    """The two engines' configs from plain sizes (DI roles: kv_producer -> kv_consumer)."""
    out = []
    for side, tp, dcp, mode, role in (("prefill", prefill_tp, prefill_dcp, "prefill",
                                       "kv_producer" if prefill_dcp != 1 else None),
                                      ("decode", decode_tp, decode_dcp, "decode", None)):
        try:
            out.append(DCPConfig(tp=tp, dcp=dcp, mode=mode, block_size=block_size,
                                 interleave_size=interleave_size, num_kv_heads=num_kv_heads,
                                 kv_role=role))
        except DCPConfigError as e:
            raise DCPTransferError(f"the {side} engine's layout is invalid: {e}") from e
    return out[0], out[1]


def plan_transfer(prefill: DCPConfig, decode: DCPConfig) -> TransferPlan:
    """Plan the prefill -> decode KV transfer; raises DCPTransferError if it cannot be served."""
    violations = transfer_violations(prefill, decode)
    if violations:
        msg = violations[0] if len(violations) == 1 else (
            f"{len(violations)} reasons the transfer cannot be served:\n"
            + "\n".join(f"  - {v}" for v in violations))
        raise DCPTransferError(msg)
    pt, dt = _topo(prefill), _topo(decode)
    ranks = tuple(_decode_rank_plan(pt, dt, d) for d in range(decode.tp))
    hp, hd = _heads_per_rank(prefill), _heads_per_rank(decode)
    kind = "match" if hp == hd else ("split" if hp > hd else "merge")
    return TransferPlan(prefill=prefill, decode=decode, kind=kind, ranks=ranks)


def transfer_violations(prefill: DCPConfig, decode: DCPConfig) -> list[str]:
    """Every reason why (prefill, decode) cannot be served, as error messages."""
    out = []
    for side, cfg, mode in (("prefill", prefill, "prefill"), ("decode", decode, "decode")):
        if cfg.mode != mode:
            out.append(f"the {side} engine's config must have mode={mode!r}: mode={cfg.mode!r}. "
                       f"Build it with DCPConfig(..., mode={mode!r}).")
        if cfg.num_kv_heads is None:
            out.append(f"planning a transfer needs num_kv_heads: {side} num_kv_heads=None. "
                       "Pass the model's KV head count.")
    if out:
        return out
    hkv = prefill.num_kv_heads
    if decode.num_kv_heads != hkv:
        out.append(f"prefill and decode must serve the same model: prefill num_kv_heads={hkv}, "
                   f"decode num_kv_heads={decode.num_kv_heads}. Use one num_kv_heads.")
        return out
    for side, cfg in (("prefill", prefill), ("decode", decode)):
        shard = cfg.attention_shard
        if hkv % shard and shard % hkv:
            where = "dcp_tp_group (TP/DCP)" if side == "prefill" else "full TP"
            out.append(f"{side} KV heads must split over, or replicate evenly across, {where}: "
                       f"num_kv_heads={hkv}, shard={shard} (tp={cfg.tp}, dcp={cfg.dcp}). Use a "
                       f"tp whose shard divides or is a multiple of {hkv}.")
    if out:
        return out
    if decode.dcp > 1:
        dt = _topo(decode)
        if any(len({tuple(dt.kv_heads_of(r)) for r in g}) > 1 for g in dt.groups["dcp"]):
            out.append(f"decode DCP needs each DCP replica set to share its KV heads (tp > "
                       f"num_kv_heads and (tp // num_kv_heads) % dcp == 0): decode tp="
                       f"{decode.tp}, dcp={decode.dcp}, num_kv_heads={hkv}. Use decode "
                       f"tp={hkv * decode.dcp * max(1, -(-decode.tp // (hkv * decode.dcp)))}"
                       f", or decode dcp=1.")
    if prefill.block_size != decode.block_size:
        out.append(f"prefill and decode must use the same block_size (the spec's block_len "
                   f"comparison and the even/odd block filter assume it): prefill block_size="
                   f"{prefill.block_size}, decode block_size={decode.block_size}. Use one "
                   f"block_size on both engines.")
    for side, cfg in (("prefill", prefill), ("decode", decode)):
        if cfg.dcp > 1 and cfg.interleave_size != cfg.block_size:
            out.append(f"cp_kv_cache_interleave_size must equal block_size for DI "
                       f"compatibility: {side} interleave_size={cfg.interleave_size}, "
                       f"block_size={cfg.block_size}. Use interleave_size={cfg.block_size}.")
    return out


def _decode_rank_plan(pt: Topology, dt: Topology, d: int) -> DecodeRankPlan:
    P, D, sub = pt.dcp, dt.dcp, pt.tp // pt.dcp
    cp_d = dt.cp_rank(d)
    heads = dt.kv_heads_of(d)
    # Global block j lives on prefill cp_rank j % P and decode cp_rank j % D, so decode
    # cp_rank r meets prefill cp_rank c exactly when c = r (mod gcd(P, D)): the spec's
    # {r, r+D_DCP, ...} when D divides P, cp_rank 0 of a standard prefill, and for P < D the
    # one cp_rank r % P (chunks() keeps the blocks the two share).
    g = gcd(P, D)
    cps = [c for c in range(P) if c % g == cp_d % g]
    reads: list[HeadRead] = []
    for c in cps:
        group: list[int] = []
        group_rank = None
        for h in heads:
            holders = [c * sub + i for i in range(sub) if h in pt.kv_heads_of(c * sub + i)]
            wanting = [e for e in range(dt.tp) if h in dt.kv_heads_of(e)
                       and dt.cp_rank(e) % g == c % g]
            remote = holders[wanting.index(d) % len(holders)]
            if remote != group_rank and group:
                reads.append(_head_read(pt, group_rank, c, group, heads))
                group = []
            group_rank = remote
            group.append(h)
        reads.append(_head_read(pt, group_rank, c, group, heads))
    reads.sort(key=lambda r: (r.remote_rank, r.heads))
    return DecodeRankPlan(rank=d, cp_rank=cp_d, kv_heads=tuple(heads), reads=tuple(reads))


def _head_read(pt: Topology, remote: int, cp: int, group: list[int],
               local_heads: list[int]) -> HeadRead:
    return HeadRead(remote_rank=remote, remote_cp_rank=cp, heads=tuple(group),
                    remote_head_offset=group[0] - pt.kv_heads_of(remote)[0],
                    local_head_offset=group[0] - local_heads[0])


# ---------------------------------------------------------------------------------------
# The specification's formula, literally (for comparison; see the module docstring)
# ---------------------------------------------------------------------------------------


def spec_quantities(prefill: DCPConfig, decode: DCPConfig) -> dict:
    """tp_ratio, head_ratio, inverse_head_ratio, num_target_ranks as the spec defines them."""
    remote_block_len = prefill.block_size * _heads_per_rank(prefill)
    local_block_len = decode.block_size * _heads_per_rank(decode)
    tp_ratio = prefill.tp // decode.tp
    head_ratio = max(1, remote_block_len // local_block_len)
    # The spec uses inverse_head_ratio without defining it; the merge case's reciprocal.
    inverse_head_ratio = max(1, local_block_len // remote_block_len)
    return {"tp_ratio": tp_ratio, "head_ratio": head_ratio,
            "inverse_head_ratio": inverse_head_ratio,
            "num_target_ranks": tp_ratio * head_ratio}


def spec_remote_ranks(prefill: DCPConfig, decode: DCPConfig, decode_rank: int):
    """The spec's "Remote Rank Computation" transcribed as written; None where it divides by 0.

    Not used for planning: it disagrees with the spec's examples (module docstring).
    """
    P_TP, D_TP, D_DCP = prefill.tp, decode.tp, decode.dcp
    q = spec_quantities(prefill, decode)
    num_target_ranks, inverse_head_ratio = q["num_target_ranks"], q["inverse_head_ratio"]
    decode_tp_rank, dcp_rank = decode_rank, decode_rank % D_DCP
    try:
        if inverse_head_ratio > 1:
            p_dcp = num_target_ranks // inverse_head_ratio
            tp_pair_size = P_TP // p_dcp
            remote_ranks = [ep + cp * tp_pair_size
                            for hp in range(inverse_head_ratio)
                            for cp in range(p_dcp)
                            for ep in [decode_tp_rank * inverse_head_ratio + hp]]
        else:
            stride = P_TP // num_target_ranks
            effective_pos = decode_tp_rank * (P_TP // num_target_ranks) // D_TP
            remote_ranks = [effective_pos + i * stride for i in range(num_target_ranks)]
    except ZeroDivisionError:
        return None
    if D_DCP > 1:
        remote_ranks = [r for i, r in enumerate(remote_ranks) if i % D_DCP == dcp_rank]
    return remote_ranks


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------


def table_entries(seq_len: int, cfg: DCPConfig) -> int:
    """Block-table entries a sequence of ``seq_len`` positions uses: one per vblock
    (``block_size * dcp`` global positions), the same on every rank of the engine."""
    return -(-seq_len // cfg.vblock)


def _topo(cfg: DCPConfig) -> Topology:
    return topology(cfg.tp, cfg.dcp, cfg.mode, num_kv_heads=cfg.num_kv_heads, config=cfg)


def _heads_per_rank(cfg: DCPConfig) -> int:
    return cfg.kv_heads_per_rank


def _run_length(cfg: DCPConfig) -> int:
    """Aligned positions that stay contiguous in one block of one owner's cache."""
    return cfg.interleave_size if cfg.dcp > 1 else cfg.block_size


def _block_table(table, seq_len: int, cfg: DCPConfig, side: str) -> torch.Tensor:
    t = torch.as_tensor(table if table is not None else [], dtype=torch.int64).reshape(-1)
    need = table_entries(seq_len, cfg)
    if t.numel() < need:
        raise DCPTransferError(f"{side} block table too short for the sequence: seq_len={seq_len}"
                               f", {t.numel()} entries, {need} needed (one per vblock of "
                               f"{cfg.vblock} positions). Pass the request's full block table.")
    if need and int(t[:need].min()) < 0:
        raise DCPTransferError(f"{side} block table has a negative entry among its first {need}: "
                               f"{t[:need].tolist()}. Pass allocated block indices.")
    return t


def _lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


def _affine_fit(xs: list[int]):
    if not xs:
        return None
    a = xs[1] - xs[0] if len(xs) > 1 else 1
    b = xs[0]
    return (a, b) if all(x == a * m + b for m, x in enumerate(xs)) else None


def _affine_text(a: int, b: int) -> str:
    lead = "m" if a == 1 else f"{a}m"
    return lead if b == 0 else f"{lead}+{b}"


def _engine_json(cfg: DCPConfig) -> dict:
    return {"tp": cfg.tp, "dcp": cfg.dcp, "num_kv_heads": cfg.num_kv_heads,
            "block_size": cfg.block_size, "interleave_size": cfg.interleave_size,
            "kv_heads_per_rank": _heads_per_rank(cfg)}

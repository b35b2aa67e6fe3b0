"""Process groups by role (spec: "Process Groups", "cp_rank: Prefill vs Decode")."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.names import Mode


@dataclass(frozen=True)
class Topology:
    """Every group of every role as a full partition of ``range(tp)``.

    Roles — prefill: ``world``, ``dcp_tp`` (TP/DCP consecutive ranks: SP gather/scatter and
    QKV/O sharding), ``cp_kv`` (DCP strided ranks: same heads, different tokens);
    decode: ``tp`` (the world) and ``dcp`` (DCP consecutive ranks sharing one KV head).
    """

    tp: int
    dcp: int
    mode: str
    groups: dict[str, list[list[int]]]
    num_kv_heads: int | None = None
    # The role whose groups are the DCP groups (where Q/LSE gathers and head reduce-scatters run).
    kv_shard_role: str = field(default="dcp")

    def cp_rank(self, rank: int) -> int:
        """Which token shard a rank holds: prefill tp_rank // (TP/DCP), decode tp_rank % DCP."""
        self._check_rank(rank)
        if self.mode == Mode.PREFILL:
            return rank // (self.tp // self.dcp)
        return rank % self.dcp

    def group_of(self, role: str, rank: int) -> list[int]:
        self._check_rank(rank)
        for g in self.groups[role]:
            if rank in g:
                return g
        raise AssertionError(f"rank {rank} missing from role {role}")

    def kv_heads_of(self, rank: int) -> list[int] | None:
        """KV heads a rank holds: decode shards them over full TP (replicated when tp > heads),
        prefill over dcp_tp_group."""
        self._check_rank(rank)
        if self.num_kv_heads is None:
            return None
        shard = self.tp if self.mode == Mode.DECODE else self.tp // self.dcp
        pos = rank if self.mode == Mode.DECODE else rank % shard
        hkv = self.num_kv_heads
        if shard >= hkv:
            return [pos // (shard // hkv)]
        per = hkv // shard
        return list(range(pos * per, (pos + 1) * per))

    def to_json(self) -> dict:
        return {
            "tp": self.tp, "dcp": self.dcp, "mode": self.mode,
            "groups": self.groups,
            "cp_rank": [self.cp_rank(r) for r in range(self.tp)],
            "kv_heads": ([self.kv_heads_of(r) for r in range(self.tp)]
                         if self.num_kv_heads is not None else None),
        }

    def format_table(self) -> str:
        lines = [f"topology: tp={self.tp} dcp={self.dcp} mode={self.mode}"]
        for role, groups in self.groups.items():
            lines.append(f"  {role:<7} (size {len(groups[0])}): "
                         + " ".join(str(g) for g in groups))
        header = "  rank  cp_rank  " + "  ".join(f"{r:<7}" for r in self.groups)
        if self.num_kv_heads is not None:
            header += "  kv_heads"
        lines.append(header)
        for r in range(self.tp):
            idx = [str(self.groups[role].index(self.group_of(role, r)))
                   for role in self.groups]
            row = f"  {r:<4}  {self.cp_rank(r):<7}  " + "  ".join(f"#{i:<6}" for i in idx)
            if self.num_kv_heads is not None:
                row += f"  {self.kv_heads_of(r)}"
            lines.append(row)
        return "\n".join(lines)

    def _check_rank(self, rank: int) -> None:
        if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < self.tp):
            raise ValueError(f"rank out of range: rank={rank!r}, tp={self.tp}. "
                             f"Use 0 <= rank < {self.tp}.")


def _consecutive(world: int, size: int) -> list[list[int]]:
    return [list(range(s, s + size)) for s in range(0, world, size)]


def _strided(world: int, stride: int) -> list[list[int]]:
    return [list(range(s, world, stride)) for s in range(stride)]


def topology(tp: int, dcp: int, mode: str = Mode.DECODE, *, num_kv_heads: int | None = None,
             config: DCPConfig | None = None) -> Topology:
    """Process groups for ``tp`` ranks with DCP degree ``dcp`` in ``mode``.

    Validates (tp, dcp, mode) through :class:`DCPConfig`, so a bad layout raises
    :class:`DCPConfigError` with every violated rule.
    """
    if config is None:
        config = DCPConfig(tp=tp, dcp=dcp, mode=mode, num_kv_heads=num_kv_heads,
                           num_q_heads=None)
    tp, dcp, mode = config.tp, config.dcp, config.mode
    if mode == Mode.PREFILL:
        sub = tp // dcp
        groups = {"world": [list(range(tp))],
                  "dcp_tp": _consecutive(tp, sub),
                  "cp_kv": _strided(tp, sub)}
        role = "cp_kv"
    else:
        groups = {"tp": [list(range(tp))], "dcp": _consecutive(tp, dcp)}
        role = "dcp"
    return Topology(tp=tp, dcp=dcp, mode=mode, groups=groups,
                    num_kv_heads=config.num_kv_heads if config.num_kv_heads is not None
                    else num_kv_heads, kv_shard_role=role)

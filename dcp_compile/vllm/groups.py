"""vLLM's tensor- and decode-context-parallel groups as the program's roles.

The program's collectives name roles (``tp``, ``dcp``, ``world`` ...); a rank binds each to a
process group's name. Under vLLM the groups exist already (vLLM made them, over gloo on
CPU), so the plugin binds vLLM's own groups, after checking that each holds exactly the
ranks the program's topology gives that role: a program whose DCP groups were not vLLM's
would combine the wrong ranks' partial attention.
"""

from __future__ import annotations

from dcp_compile.runtime.errors import DCPConfigError
from dcp_compile.runtime.names import Role


def vllm_group_names(topology) -> tuple[int, dict[str, str]]:
    """(this rank's tp rank, role -> vLLM's group name) for a decode program's topology."""
    from vllm.distributed.parallel_state import get_dcp_group, get_tp_group

    tp, dcp = get_tp_group(), get_dcp_group()
    rank = tp.rank_in_group
    base = min(tp.ranks)             # the program's ranks are tp ranks: 0..tp-1
    ours = {Role.TP: tp, Role.DCP: dcp}
    names = {}
    for role in topology.groups:
        group = ours.get(role)
        if group is None:
            raise DCPConfigError(
                f"the program needs a {role!r} group, which vLLM's tp/dcp groups do not give: "
                f"roles {sorted(topology.groups)}. Serve a decode-mode program "
                f"(transform(..., mode=Mode.DECODE)).")
        want = topology.group_of(role, rank)
        got = sorted(r - base for r in group.ranks)
        if got != want:
            raise DCPConfigError(
                f"vLLM's {role} group of tp rank {rank} is ranks {got}, the program's is "
                f"{want}: the program's topology (tp={topology.tp}, dcp={topology.dcp}) is "
                f"not vLLM's. Transform with vLLM's tensor_parallel_size and "
                f"decode_context_parallel_size.")
        names[role] = group.device_group.group_name
    return rank, names

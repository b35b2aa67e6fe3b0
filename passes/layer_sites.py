"""More attention sites in a step's graph than attention layers the model declares: name why.

Each declared layer owns one KV cache (passes/insert_paged_cache.py). A graph with more
sites than layers is refused; these checks name the form behind the extra sites, with the
module and source line, before the plain count mismatch is reported: a layer attending twice
over one K (DiffLlama's differential attention), or an attention module that runs more than
once per step (layers looped with shared weights: Dory's recurrent depth).
"""

from __future__ import annotations

from dcp_compile.runtime.errors import DCPTransformError

from .infra import source_of


def twice_over_one_key(sites: list, layers: int) -> None:
    """Refuse a layer that attends twice over one K (more sites than layers, two of them
    reading the same key node), naming both calls: DiffLlama's differential attention."""
    first = {}
    for s in sites:
        a = first.setdefault(s.k, s)
        if a is s:
            continue
        raise DCPTransformError(
            f"attention {s.node.name} ({source_of(s.node)}) attends over the same keys as "
            f"attention {a.node.name} ({source_of(a.node)}): a layer computes softmax "
            f"attention twice over one K ({len(sites)} attention sites for the {layers} "
            f"attention layers the model declares). This is differential attention "
            f"(DiffLlama: softmax(Q K^T) over two halves of V, then head h of the first "
            f"minus lambda times head h + H/2 of the second, normalised per pair), which "
            f"dcp_compile does not shard: it keeps one attention and one KV cache per layer, and the combination "
            f"pairs heads that a TP layout by heads puts on different ranks. Not a limit of "
            f"DCP (the two calls share Q, K and the softmax: they are one attention over "
            f"V = cat([V1, V2], dim=-1)); until dcp_compile reads that form, serve the model "
            f"without dcp_compile.")


def _module_path(n) -> str | None:
    """The innermost module a node ran in (``nn_module_stack``), by its path."""
    stack = n.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else None


def looped_layers(sites: list, layers: int) -> None:
    """Refuse a model whose attention module runs more than once per step (its layers looped
    with shared weights, Dory's ``n_recurrent_loops``), naming the module and how often it ran."""
    runs: dict[str, list] = {}
    for s in sites:
        path = _module_path(s.node)
        if path is not None:
            runs.setdefault(path, []).append(s)
    looped = {p: ss for p, ss in runs.items() if len(ss) > 1}
    if not looped:
        return
    path, ss = next(iter(looped.items()))
    raise DCPTransformError(
        f"attention module {path} runs {len(ss)} times in one step ({source_of(ss[0].node)}): "
        f"the model loops its layers with shared weights (a recurrent-depth model, e.g. "
        f"Dory's n_recurrent_loops), {len(sites)} attention sites for the {layers} attention "
        f"layers its config declares. dcp_compile gives each declared layer one KV cache and does not "
        f"know which cache each loop reads or writes (Dory's cache modes: a copy per loop, "
        f"or earlier loops reading the last loop's past). Serving it needs one declared "
        f"layer per loop and a rule for which cache each loop reads; until then serve it "
        f"without dcp_compile.")

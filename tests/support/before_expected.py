"""Before/Expected pass tests: a hand-built "before" graph, one pass, the expected code.

``before(fn, **inputs)`` traces a small function (aten / ``torch.ops.dcp`` calls written out,
as a captured graph would hold them) into a GraphModule whose nodes carry fake values, the
way torch.export leaves them: the placeholders are named after ``fn``'s arguments and
``inputs`` gives each one an example tensor (kept for numeric checks). ``run_alone`` runs one
pass through the real pass manager (``dcp_compile.passes.manager.run_passes``: lint and shape
propagation after it) and ``code`` prints the result in a normalised form to compare with an
expected string written in the test: FX's generated node names (`getitem_5`, whose number
counts every getitem ever created, and whose base is the torch release's choice) become
stable ones numbered by order of definition, so the expected texts survive torch releases.
"""

from __future__ import annotations

import collections
import functools
import re
import textwrap

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, symbolic_trace
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dcp_compile import DCPConfig
from dcp_compile.passes.infra import TransformContext
from dcp_compile.passes.manager import run_passes

aten = torch.ops.aten


def before(fn, **inputs: torch.Tensor) -> GraphModule:
    """``fn`` traced; every node's meta['val'] a fake tensor propagated from ``inputs``."""
    gm = symbolic_trace(fn)
    mode = FakeTensorMode()
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    missing = sorted({n.name for n in phs} - set(inputs))
    assert not missing, f"no example tensor for inputs {missing}"
    fakes = [mode.from_tensor(inputs[n.name]) for n in phs]
    for n, f in zip(phs, fakes):
        n.meta["val"] = f
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    gm.meta["example_inputs"] = dict(inputs)
    return gm


def context(tp: int, dcp: int, step: str, **config) -> TransformContext:
    """The TransformContext of one step kind (mode from the step unless given)."""
    config.setdefault("mode", "prefill" if step == "prefill" else "decode")
    return TransformContext(config=DCPConfig(tp=tp, dcp=dcp, **config), step=step)


def run_alone(p, gm: GraphModule) -> GraphModule:
    """Run pass ``p`` alone through the pass manager; returns the rewritten graph."""
    gm, records = run_passes(gm, [p], step=p.ctx.step)
    assert [r.name for r in records] == [p.name]
    return gm


_DEAD = re.compile(r";\s+[\w\s=]+ = None$")     # FX's `x = y = None` (frees values early)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name.replace(".", "_")).lower()


def _stable_base(target) -> str:
    """The name we give a node calling ``target``: `add_tensor` for aten.add.Tensor,
    `getitem` for operator.getitem (ours, so no torch release can change it)."""
    if isinstance(target, torch._ops.OpOverload):
        return _snake(f"{target._opname}_{target._overloadname}")
    return _snake(target if isinstance(target, str) else target.__name__)


@functools.lru_cache(maxsize=None)
def _fx_base(op: str, target) -> str:
    """The name this torch release's FX gives the first node calling ``target``."""
    return Graph().create_node(op, target, (), {}).name


def generated_names(gm: GraphModule) -> dict[str, str]:
    """Node names FX generated (its name for the target, maybe with a `_<n>` suffix) ->
    stable names: our base for the target, numbered by order of definition (`getitem`,
    `getitem_1`, ...). The numbers FX hands out depend on every node ever created and
    erased, and its bases on the torch release; names a pass chose (`cp_rank`) stay."""
    generated = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                 and re.fullmatch(re.escape(_fx_base(n.op, n.target)) + r"(_\d+)?", n.name)]
    chosen = {n.name for n in gm.graph.nodes} - {n.name for n in generated}
    seen: collections.Counter = collections.Counter()
    renames = {}
    for n in generated:
        base = _stable_base(n.target)
        k = seen[base]
        name = base if k == 0 else f"{base}_{k}"
        while name in chosen:                   # a pass chose it: skip that number
            k += 1
            name = f"{base}_{k}"
        seen[base] = k + 1
        renames[n.name] = name
    return renames


def code(gm: GraphModule) -> str:
    """``gm.code`` normalised: FX's generated node names replaced by stable ones
    (generated_names), no `torch.ops.` prefixes, no freeing of dead names, no comments or
    blank lines, dedented."""
    gm.recompile()
    renames = generated_names(gm)
    rename = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, renames)) + r")(?!\w)") \
        if renames else None
    lines = []
    for line in gm.code.splitlines():
        line = _DEAD.sub("", line.split("  #")[0].rstrip()).replace("torch.ops.", "")
        if rename is not None:
            line = rename.sub(lambda m: renames[m.group(1)], line)
        if line.strip() and not line.strip().startswith("#"):
            lines.append(line)
    return textwrap.dedent("\n".join(lines))


def expected(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def assert_code(gm: GraphModule, text: str) -> None:
    got, want = code(gm), expected(text)
    assert got == want, f"graph after the pass differs:\n--- got\n{got}\n--- expected\n{want}"


def call(gm: GraphModule, **inputs):
    """Run ``gm`` on real tensors: its example inputs, overridden/extended by ``inputs``."""
    args = {**gm.meta.get("example_inputs", {}), **inputs}
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return gm(*[args[n] for n in names])


def attention_inputs(*, batch=2, tokens=1, hq=4, hkv=2, dim=8, num_blocks=5, block=16,
                     max_blocks=2, start=3, seed=0) -> dict[str, torch.Tensor]:
    """Inputs of one paged attention: q [B, S, hq, D], k/v [B, S, hkv, D], caches
    [num_blocks, block, hkv, D] holding ``start`` prior tokens per sequence, positions
    ``start..start+S-1`` and a block table of distinct blocks (the last block is the
    caches' garbage block)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)
    assert batch * max_blocks < num_blocks
    return dict(
        q=randn(batch, tokens, hq, dim), k=randn(batch, tokens, hkv, dim),
        v=randn(batch, tokens, hkv, dim), key_cache=randn(num_blocks, block, hkv, dim),
        value_cache=randn(num_blocks, block, hkv, dim),
        positions=torch.arange(start, start + tokens).expand(batch, tokens).clone(),
        block_table=torch.arange(batch * max_blocks).view(batch, max_blocks))


def annotate(gm: GraphModule, key: str, values: dict) -> GraphModule:
    """Set ``node.meta[key]`` of the nodes named in ``values`` (what an earlier pass leaves
    on the graph: roles, projections, sequence-parallel marks)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, value in values.items():
        nodes[name].meta[key] = value
    return gm


def node(like, target, *args, **kwargs):
    """In a traced function: record ``target(*args, **kwargs)`` as a node even when no
    argument is traced (``aten.arange``), on the graph of the traced value ``like``."""
    return like.tracer.create_proxy("call_function", target, args, kwargs)


def run_world(gm: GraphModule, config: DCPConfig, inputs_of_rank) -> list:
    """Run ``gm`` on every rank of ``config``'s layout (threaded world, real collectives),
    its roles bound to that rank's groups; ``inputs_of_rank(rank)`` gives the inputs by
    name. Returns each rank's outputs."""
    from dcp_compile.runtime.topology import topology
    from dcp_compile.runtime.distributed.roles import role_of
    from dcp_compile.runtime.serving.rank_program import copy_graph_module
    from dcp_compile.runtime.distributed.world import ROLE_ALIAS_PREFIX, bind_roles, run_threaded

    topo = topology(config.tp, config.dcp, config.mode, config=config)
    # Everything but running is done here, not in the rank threads (tracing patches torch
    # functions while it runs: not thread-safe): the inputs, and one graph whose roles name
    # the per-rank aliases bind_roles registers.
    per_rank = [inputs_of_rank(rank) for rank in range(config.tp)]
    local = copy_graph_module(gm)
    for n in local.graph.nodes:
        role = role_of(n)
        if role is not None:
            n.args = n.args[:-1] + (ROLE_ALIAS_PREFIX + role,)
    local.recompile()
    names = [n.name for n in local.graph.nodes if n.op == "placeholder"]

    def rank_main(rank):
        bind_roles(topo, rank, aliases=True)
        with torch.no_grad():
            return local(*[per_rank[rank][k] for k in names])

    return run_threaded(config.tp, rank_main)

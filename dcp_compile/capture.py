"""Capture: nn.Module -> ATen FX graph with fake values, attention kept whole.

``torch.export`` (non-strict) at ATen level: parameters and buffers become placeholders
(so a meta-device model transforms without allocating weights), our ``dcp`` custom ops stay
single nodes, and every node carries ``meta['val']``.

:func:`stack_traces` decides whether the nodes also carry ``meta['stack_trace']`` (the user
source line each op came from). Recording it costs 10-25% of a whole transform
(``benchmarks/bench_transform.py --stack-traces``), so the driver captures without it
unless someone will read the graphs (a dump) or a refusal has to name a source line (then
it captures again with it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from dcp_compile.runtime.errors import DCPOutputContractError, DCPTransformError


@dataclass
class Captured:
    gm: GraphModule
    params: dict[str, str]          # placeholder name -> parameter FQN
    buffers: dict[str, str]         # placeholder name -> buffer FQN
    user_inputs: list[str]          # placeholder names of the step inputs, in order
    # Tensors torch.export lifted from the forward (``torch.tensor(x)``, a list index):
    # placeholder name -> value. Program constants like buffers (listed in ``buffers`` too),
    # placed by the placement analysis like any weight: replicated, or cut where they
    # span heads.
    lifted: dict[str, torch.Tensor] = field(default_factory=dict)


def example_step_inputs(batch: int, tokens: int, max_blocks: int, cache_shape, num_layers: int,
                        *, device, dtype) -> tuple:
    """Example inputs of the step signature (values do not matter: shapes are static)."""
    ids = torch.zeros(batch, tokens, dtype=torch.int64, device=device)
    positions = torch.zeros(batch, tokens, dtype=torch.int64, device=device)
    table = torch.zeros(batch, max_blocks, dtype=torch.int64, device=device)
    caches = [torch.zeros(cache_shape, dtype=dtype, device=device)
              for _ in range(2 * num_layers)]
    return ids, positions, table, caches


@contextlib.contextmanager
def stack_traces(enabled: bool):
    """Within: FX tracing records each node's ``stack_trace`` (``enabled``) or not.

    torch's ``torch.fx.config.do_not_emit_stack_traces``; the previous value comes back on
    exit. Tracing looks up the source line of every frame on the stack for every node, so the
    cost grows with the caller's stack depth as well as with the graph."""
    import torch.fx.config as fx_config
    previous = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = not enabled
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = previous


def capture(model: torch.nn.Module, example_inputs: tuple) -> Captured:
    """``model`` at ATen level on ``example_inputs`` (torch.export, non-strict).

    Export regenerates the graph's Python code after each of its own passes (five times a
    capture: a fifth of its time on the fuzz's models); under torch's lazy graph modules
    (as Dynamo and Inductor run) that only marks the code stale, and it is generated once,
    when someone reads it or runs the graph."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    try:
        # Under no_grad, as a program runs: a model's own no_grad regions (PhiMoE's router)
        # are then no-ops, not higher-order ops the passes would have to read.
        with torch.no_grad(), _use_lazy_graph_module(True), keeps_tensor_attributes(model):
            ep = torch.export.export(model, example_inputs, strict=False)
    except DCPOutputContractError:
        raise                     # the model's own forward broke our contract: that is the reason
    except Exception as e:
        raise DCPTransformError(
            f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}. The model must be exportable with "
            f"static shapes (no data-dependent control flow).") from e
    sig = ep.graph_signature
    params, buffers, user_inputs, lifted = {}, {}, [], {}
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            params[spec.arg.name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffers[spec.arg.name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(spec.arg.name)
        elif spec.kind == InputKind.CONSTANT_TENSOR and spec.target in ep.constants:
            buffers[spec.arg.name] = spec.target
            lifted[spec.arg.name] = ep.constants[spec.target]
        else:
            raise DCPTransformError(f"unsupported captured input {spec.arg.name} of kind "
                                    f"{spec.kind.name}. Register constants as buffers.")
    refuse_mutation(list(sig.buffers_to_mutate) + list(sig.user_inputs_to_mutate))
    gm = ep.graph_module
    return Captured(gm=gm, params=params, buffers=buffers, user_inputs=user_inputs,
                    lifted=lifted)


@contextlib.contextmanager
def keeps_tensor_attributes(root: torch.nn.Module):
    """Undo, on the way out, the fake tensors a fake run (torch.export, a fake-mode trace)
    cached on the modules as plain attributes: LongRoPE's rotary embedding stores
    ``long_inv_freq`` so; the next capture would meet a fake tensor of another fake mode."""
    from torch._subclasses.fake_tensor import FakeTensor

    kept = {(m, k): v for m in root.modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor)}
    try:
        yield
    finally:
        for m in root.modules():
            for k, v in list(vars(m).items()):
                if isinstance(v, FakeTensor):
                    if (m, k) in kept:
                        setattr(m, k, kept[(m, k)])
                    else:
                        delattr(m, k)


def refuse_mutation(mutated: list) -> None:
    """Both capture frontends (this one and :mod:`dcp_compile.frontends.dynamo`): a step that
    writes an input or buffer in place cannot be sharded as a pure function of its inputs."""
    if mutated:
        raise DCPTransformError(
            f"the model mutates its inputs or buffers in place ({mutated}): KV caches "
            f"must be written functionally (return the new caches, as dcp.paged_attention "
            f"does).")


def constant_values(model: torch.nn.Module, captured: Captured) -> dict[str, torch.Tensor]:
    """placeholder name -> the model's full (unsharded) parameter or buffer tensor."""
    # Tied weights appear under every name export may have used for them.
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    out = {}
    for name, fqn in {**captured.params, **captured.buffers}.items():
        out[name] = captured.lifted[name] if name in captured.lifted else state[fqn]
    return out


def checkpoint_names(step_module: torch.nn.Module, captured: Captured,
                     root: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """placeholder -> every name its parameter or persistent buffer has in ``root``'s state
    dict (``root``: the model a checkpoint is of; ``step_module`` may wrap it): the first its
    own, the others tied aliases. Found by the tensor itself, so a wrapper's prefix never
    leaks into the names. Non-persistent buffers (RoPE tables) and lifted constants are not
    in a checkpoint and get no name: the program keeps their values."""
    names_by_id: dict[int, list[str]] = {}
    for fqn, t in root.state_dict(keep_vars=True).items():
        names_by_id.setdefault(id(t), []).append(fqn)
    out = {}
    for name, fqn in {**captured.params, **captured.buffers}.items():
        if name in captured.lifted:
            continue
        tensor = step_module.get_parameter(fqn) if name in captured.params else \
            step_module.get_buffer(fqn)
        names = names_by_id.get(id(tensor))
        if names:
            out[name] = tuple(names)
    return out


HOST = torch.device("cpu")


def meta_to_host(gm: GraphModule) -> int:
    """Point the ops a meta-device model's graph creates tensors with (``arange``, ``zeros``,
    ``_to_copy``: their ``device`` arguments) at the host instead of the meta device, as
    capturing the model with its weights on the host gives; returns how many arguments
    changed. A meta capture has no real device, and a program runs where its weights are
    read (the host). Other devices are left as captured."""
    changed = 0

    def host(a):
        nonlocal changed
        if isinstance(a, torch.device) and a.type == "meta":
            changed += 1
            return HOST
        return a

    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.args = torch.fx.node.map_aggregate(n.args, host)
            n.kwargs = torch.fx.node.map_aggregate(n.kwargs, host)
    if changed:
        gm.recompile()
    return changed

"""Mixture-of-experts blocks of the model libraries, read at the module level: each becomes
one ``dcp.moe`` call while ``transform()`` captures the model.

torch.export cannot capture these blocks as written, and should not: litgpt's ``LLaMAMoE``
picks each expert's tokens with ``torch.where(mask)`` (a shape that depends on the routing),
torchtitan's ``RoutedExperts`` sorts the tokens into groups of data-dependent sizes for
``torch._grouped_mm``. Both compute what ``dcp.moe`` computes — gated experts, the routing
weight applied to each expert's output, summed over the top-k — so, as transformers' experts
interface lets the HF frontend route experts to ``"dcp"``, the ordinary frontend swaps the
block's forward (on the instance, for the capture only) for one that calls ``dcp.moe``.

No guessing: a rule (``RULES``, one row per library block) names the class, and the source
of every function whose meaning the swap relies on is pinned by its hash (the library
versions of requirements/corpus.txt). A block of a listed class whose code differs (another
version, a subclass, an override of ``_grouped_mm``) is refused, naming what changed.

Stacked weights. ``dcp.moe`` takes each projection of all experts as one ``[E, ...]``
parameter. litgpt keeps one module per expert and torchtitan keeps gate (``w1``) and up
(``w3``) apart, so the frontend builds the stacked tensors once (``StackedExperts``, held by
the step module, so they are captured as parameters and the program keeps their values;
on a meta-device model they are meta too). They are copies: a checkpoint has no tensor of
that name, so these weights come with the program, not from a checkpoint
(``checkpoint_names`` gives them no name).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from dcp_compile.runtime.errors import DCPTransformError


def source_hash(fn) -> str:
    """The first 12 hex digits of the sha256 of ``fn``'s source."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:12]


def _parameter(t: Tensor | None) -> nn.Parameter | None:
    """The model's own parameter as it is (captured under its own name), or a new one."""
    if t is None or isinstance(t, nn.Parameter):
        return t
    return nn.Parameter(t.detach(), requires_grad=False)


class StackedExperts(nn.Module):
    """One MoE block's experts as dcp.moe takes them: ``gate_up_proj [E, 2I, H]`` ([gate;
    up]; ``[E, H, 2I]`` transposed), ``down_proj [E, H, I]`` (``[E, I, H]``), optional
    biases ``[E, 2I]`` / ``[E, H]``, and the op's data (activation, layout)."""

    def __init__(self, gate_up: Tensor, down: Tensor, gate_up_bias: Tensor | None = None,
                 down_bias: Tensor | None = None, *, activation: str = "silu",
                 layout: str = "concatenated"):
        super().__init__()
        self.gate_up_proj = _parameter(gate_up)
        self.down_proj = _parameter(down)
        self.gate_up_bias = _parameter(gate_up_bias)
        self.down_bias = _parameter(down_bias)
        self.activation, self.layout = activation, layout

    def moe(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """dcp.moe over ``x [T, H]`` with these experts, one device (rank 0, all experts)."""
        rank0 = torch.zeros((), dtype=torch.int64, device=x.device)
        biases = {} if self.gate_up_bias is None else {"gate_up_bias": self.gate_up_bias,
                                                       "down_bias": self.down_bias}
        return torch.ops.dcp.moe(x, ids.long(), weights, self.gate_up_proj, self.down_proj,
                                 rank0, activation=self.activation, layout=self.layout,
                                 **biases)


# ------------------------------------------------------------------------------------ litgpt

def _litgpt_stack(block: nn.Module) -> StackedExperts:
    """litgpt's experts (``LLaMAMLP``: ``proj(silu(fc_1 x) * fc_2 x)``) stacked."""
    experts = list(block.experts)
    gate_up = torch.stack([torch.cat([e.fc_1.weight, e.fc_2.weight]) for e in experts])
    down = torch.stack([e.proj.weight for e in experts])
    if experts[0].fc_1.bias is None:
        return StackedExperts(gate_up, down)
    return StackedExperts(gate_up, down,
                          torch.stack([torch.cat([e.fc_1.bias, e.fc_2.bias]) for e in experts]),
                          torch.stack([e.proj.bias for e in experts]))


def _litgpt_forward(block: nn.Module, stacked: StackedExperts) -> Callable:
    """``LLaMAMoE.forward`` (litgpt 0.5.13, litgpt/model.py) with its per-expert
    ``torch.where`` loop as one dcp.moe: the router lines are the model's own, verbatim."""
    config = block.config

    def forward(x: Tensor) -> Tensor:
        B, T, C = x.size()
        residual_x = x
        x = x.reshape(-1, C)
        if not config.n_expert_groups:
            router = block.gate(x)
            probs, indices = torch.topk(router, config.n_expert_per_token)
            probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        else:
            probs, indices = block.gate(x)
        if config.routed_scaling_factor != 1.0:
            probs = probs * config.routed_scaling_factor
        y = stacked.moe(x, indices, probs).view(B, T, C)
        if config.n_shared_expert:
            y = y + block.shared_experts(residual_x)
        return y
    return forward


def _litgpt_experts(block: nn.Module) -> list:
    return list(block.experts)


# -------------------------------------------------------------------------------- torchtitan

def _titan_stack(block: nn.Module) -> StackedExperts:
    """torchtitan's ``GroupedExperts`` (``w2(silu(w1 x) * w3 x)``, weights ``[E, F, D]``,
    ``[E, D, F]``): gate and up concatenated, in bf16 as its pinned forward casts them
    (``canonicalize_moe`` refuses experts narrower than the model's tokens)."""
    inner = block.routed_experts.inner_experts
    return StackedExperts(torch.cat([inner.w1_EFD, inner.w3_EFD], dim=1).bfloat16(),
                          inner.w2_EDF.bfloat16())


def _titan_forward(block: nn.Module, stacked: StackedExperts) -> Callable:
    """``MoE.forward`` (torchtitan 0.3.0, eval) with its routed experts (dispatch: sort by
    expert; grouped experts; combine: scores times outputs, scatter-add back) as one dcp.moe.
    The router and the shared experts are the model's own modules; the per-expert token
    counts it builds for the grouped matmul and the training-only usage count are not
    needed by dcp.moe."""

    def forward(x_BLD: Tensor) -> Tensor:
        topk_scores_BLK, topk_expert_ids_BLK, _ = block.router(x_BLD, block.expert_bias_E)
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        out_BLD = stacked.moe(x_BLD.reshape(B * L, D), topk_expert_ids_BLK.reshape(B * L, K),
                              topk_scores_BLK.reshape(B * L, K)).view(B, L, D)
        if block.shared_experts is not None:
            out_BLD = out_BLD + block.shared_experts(x_BLD)
        return out_BLD
    return forward


def _titan_parts(block: nn.Module) -> list:
    routed = block.routed_experts
    return [routed, routed.inner_experts, routed.token_dispatcher]


def _titan_unparallelised(block: nn.Module) -> str | None:
    if block.training:
        return ("it is in training mode (its forward then counts expert usage into a "
                "buffer); call model.eval() first")
    if getattr(block.routed_experts.token_dispatcher, "ep_mesh", None) is not None:
        return ("its token dispatcher has an expert-parallel mesh (torchtitan's own "
                "parallelize ran); transform the model before torchtitan parallelises it")
    return None


# ----------------------------------------------------------------------- transformers Llama-4

@functools.lru_cache(maxsize=None)
def hf_expert_activations() -> dict:
    """transformers' activation module class -> dcp.moe's ``ExpertActivation`` (the HF
    frontend's experts classes and Llama-4's experts read it)."""
    from transformers import activations as A

    from dcp_compile.runtime.kernels.moe import ExpertActivation as Act
    return {A.SiLUActivation: Act.SILU, nn.SiLU: Act.SILU, nn.ReLU: Act.RELU,
            A.GELUTanh: Act.GELU_TANH, A.ReLUSquaredActivation: Act.RELU2}


def _bailing_gate(experts: nn.Module):
    """Bailing-hybrid's ``_apply_gate``: the default ``act(gate) * up`` when its config sets no
    ``swiglu_limits`` for the layer (``limit`` None); a clamped gate is refused by name."""
    act = expert_activation(experts.act_fn)
    if act is None or experts.limit is not None:
        raise DCPTransformError(
            f"{type(experts).__name__}: its gate clamps act(gate) and up at "
            f"limit={experts.limit} (config.swiglu_limits), or its activation "
            f"{experts.act_fn} is not one dcp.moe computes: dcp.moe has no such gate. Use a "
            f"config without swiglu_limits (or add the clamped gate to dcp.moe's GATES).")
    return act, False, {}


def _deepseek_v4_gate(experts: nn.Module):
    """DeepSeek-V4's ``_apply_gate``: ``act(min(gate, limit)) * clamp(up, ±limit)`` (the clamp
    before the activation, unlike Bailing's), dcp.moe's ``clamped_silu`` for a SiLU act."""
    from dcp_compile.runtime.kernels.moe import ExpertActivation as Act
    if expert_activation(experts.act_fn) is not Act.SILU or experts.limit is None:
        raise DCPTransformError(
            f"{type(experts).__name__}: its gate is act(min(gate, limit)) * clamp(up, ±limit) "
            f"with activation {experts.act_fn} and limit={experts.limit}: dcp.moe computes it "
            f"for SiLU and a limit (clamped_silu). Use hidden_act='silu' and a swiglu_limit.")
    return Act.CLAMPED_SILU, False, {"limit": float(experts.limit)}


def _hy_v4_gate(experts: nn.Module):
    """HY-V4's ``_apply_gate``: ``F.silu(min(gate, swiglu_limit)) * clamp(up, ±swiglu_limit)``
    (SiLU written in the gate, not read from ``act_fn``): ``clamped_silu``."""
    from dcp_compile.runtime.kernels.moe import ExpertActivation as Act
    return Act.CLAMPED_SILU, False, {"limit": float(experts.swiglu_limit)}


def _minimax_m3_gate(experts: nn.Module):
    """MiniMax-M3's ``_apply_gate``: gpt-oss's clamped SwiGLU (``swiglu_alpha``,
    ``swiglu_limit``) over concatenated [gate; up]."""
    from dcp_compile.runtime.kernels.moe import ExpertActivation as Act
    return Act.CLAMPED_SWIGLU, False, {"alpha": float(experts.swiglu_alpha),
                                       "limit": float(experts.swiglu_limit)}


def _optional_gate(module: str, cls: str, gate) -> dict:
    """``{cls._apply_gate: gate}`` where transformers has ``module.cls``; a transformers without
    the model type (vLLM's pinned one) has no such class to meet."""
    import importlib
    try:
        return {getattr(importlib.import_module(module), cls)._apply_gate: gate}
    except (ModuleNotFoundError, AttributeError):
        return {}


def more_expert_gates() -> dict:
    """Experts classes' own ``_apply_gate`` the HF frontend's gate table adds
    (``hf_experts._gate_table``): the method -> (activation, interleaved, params)."""
    models = "transformers.models"
    return {**_optional_gate(f"{models}.bailing_hybrid.modeling_bailing_hybrid",
                             "BailingHybridExperts", _bailing_gate),
            **_optional_gate(f"{models}.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Experts",
                             _deepseek_v4_gate),
            **_optional_gate(f"{models}.hy_v4.modeling_hy_v4", "HYV4Experts", _hy_v4_gate),
            **_optional_gate(f"{models}.minimax_m3_vl.modeling_minimax_m3_vl",
                             "MiniMaxM3VLExperts", _minimax_m3_gate)}


def expert_activation(act_fn):
    """dcp.moe's ``ExpertActivation`` of an experts class's ``act_fn``, or None: an activation
    module by its type (``hf_expert_activations``), a torch function by identity (LFM2-MoE's
    ``Lfm2MoeExperts`` sets ``self.act_fn = F.silu``, whatever its config says)."""
    from dcp_compile.runtime.kernels.moe import ExpertActivation as Act
    functions = {nn.functional.silu: Act.SILU, nn.functional.relu: Act.RELU,
                 torch.relu: Act.RELU}
    return hf_expert_activations().get(type(act_fn)) or functions.get(act_fn)


def _llama4_stack(block: nn.Module) -> StackedExperts:
    """``Llama4TextExperts``: ``bmm(x, gate_up_proj [E, H, 2I])``, ``chunk(2)`` -> gate, up,
    ``bmm(up * act(gate), down_proj [E, I, H])``: transposed, concatenated; its own
    parameters (no copy)."""
    _ACTIVATIONS = hf_expert_activations()
    experts = block.experts
    act = _ACTIVATIONS.get(type(experts.act_fn))
    if act is None:
        raise DCPTransformError(
            f"Llama4TextExperts' activation {type(experts.act_fn).__name__} is not one "
            f"dcp.moe computes ({sorted(a.value for a in set(_ACTIVATIONS.values()))}). Use "
            f"hidden_act='silu'.")
    return StackedExperts(experts.gate_up_proj, experts.down_proj, activation=act,
                          layout="concatenated_transposed")


def _llama4_forward(block: nn.Module, stacked: StackedExperts) -> Callable:
    """``Llama4TextMoe.forward`` (transformers 5): every expert runs on every token, its input
    scaled by the token's sigmoid score (0 for experts not in its top-k: sigmoid(-inf)), and
    the outputs summed. An expert of a zero input is zero (no biases), so this is the sum over
    the top-k of ``expert_e(score * x)``: the input, not the output, is scaled, so each choice
    is a dcp.moe of its own (top-1 of the scaled tokens, weight 1; Llama-4 routes top-1, one
    op). The router's own linear and top-k;
    its dense ``full(-inf).scatter_`` is not needed for the chosen scores."""
    k = block.top_k

    def forward(hidden_states: Tensor):
        x = hidden_states.reshape(-1, block.hidden_dim)
        router_logits = nn.Linear.forward(block.router, x)
        top_value, top_ids = torch.topk(router_logits, k, dim=1)
        scores = torch.sigmoid(top_value.float()).to(top_value.dtype)          # [T, k]
        ones = torch.ones_like(scores[:, :1])
        routed = [stacked.moe(x * scores[:, j:j + 1], top_ids[:, j:j + 1], ones)
                  for j in range(k)]     # one dcp.moe per choice: a token stays one row
        return block.shared_expert(x) + sum(routed[1:], routed[0]), router_logits
    return forward


def _llama4_parts(block: nn.Module) -> list:
    return [block.router, block.experts, block.shared_expert]


def _llama4_state(block: nn.Module) -> str | None:
    if block.experts.act_fn is None:
        return "its experts have no activation"
    return None


# ------------------------------------------------------------------------------------- rules

@dataclass(frozen=True)
class ExpertsRule:
    """One library's MoE block: the class (``module:qualname``), the functions whose meaning
    the swap relies on (``module:qualname`` -> source hash), which submodules' classes those
    are read from, how its experts stack, and the forward that calls dcp.moe."""

    block: str
    library: str
    pinned: dict[str, set[str]]                  # what runs here -> accepted source hashes
    parts: Callable[[nn.Module], list]          # the block's submodules the pins cover
    stack: Callable[[nn.Module], StackedExperts]
    forward: Callable[[nn.Module, StackedExperts], Callable]
    why: str                                     # why torch.export cannot capture it
    definitions: dict[str, str] = field(default_factory=dict)   # functions it calls by name
    state: Callable[[nn.Module], str | None] = lambda block: None   # why not now, or None
    replaced: Callable[[nn.Module], nn.Module] = lambda block: block.experts   # not called


_LLAMA4 = "transformers.models.llama4.modeling_llama4"
_TITAN = "torchtitan.models.common"
# torchtitan's MoE with moe_comm_backend="standard" builds an AllToAllTokenDispatcher, which
# runs LocalTokenDispatcher's own dispatch and combine until it is given an EP mesh
# (``ep_mesh is None``: ``_titan_unparallelised``); both dispatchers' code is accepted.
_LOCAL_FALLBACK = {f"{_TITAN}.token_dispatcher:LocalTokenDispatcher.dispatch": "4cc2047fc69a",
                   f"{_TITAN}.token_dispatcher:LocalTokenDispatcher.combine": "a3e39756b240"}

RULES = (
    ExpertsRule(
        block="litgpt.model:LLaMAMoE", library="litgpt 0.5.13",
        pinned={"litgpt.model:LLaMAMoE.forward": {"8fbca80cb5b0"},
                "litgpt.model:LLaMAMLP.forward": {"1a88679b4724"}},
        parts=_litgpt_experts, stack=_litgpt_stack, forward=_litgpt_forward,
        why="a torch.where loop over experts (data-dependent token counts)"),
    ExpertsRule(
        block=f"{_TITAN}.moe:MoE", library="torchtitan 0.3.0",
        pinned={f"{_TITAN}.moe:MoE.forward": {"65d694c5b617"},
                f"{_TITAN}.moe:RoutedExperts.forward": {"1a660aa196e5"},
                f"{_TITAN}.moe:GroupedExperts.forward": {"a59df6e1179e"},
                f"{_TITAN}.moe:GroupedExperts._grouped_mm": {"882a2f00d3ef"},
                f"{_TITAN}.token_dispatcher:LocalTokenDispatcher.dispatch":
                    {"4cc2047fc69a", "fd3f2ca6281e"},
                f"{_TITAN}.token_dispatcher:LocalTokenDispatcher._local_reorder":
                    {"9b2c4dcb8bd4"},
                f"{_TITAN}.token_dispatcher:LocalTokenDispatcher.combine":
                    {"a3e39756b240", "05f7f2a9c1af"}},
        definitions=_LOCAL_FALLBACK, state=_titan_unparallelised,
        replaced=lambda block: block.routed_experts.inner_experts,
        parts=_titan_parts, stack=_titan_stack, forward=_titan_forward,
        why="torch._grouped_mm over tokens sorted by expert (data-dependent group sizes)"),
    ExpertsRule(
        block=f"{_LLAMA4}:Llama4TextMoe", library="transformers 5.25 (Llama-4)",
        pinned={f"{_LLAMA4}:Llama4TextMoe.forward": {"558256dc4289"},
                f"{_LLAMA4}:Llama4Router.forward": {"1f606d051a01"},
                f"{_LLAMA4}:Llama4TextExperts.forward": {"055567467fb6"}},
        parts=_llama4_parts, stack=_llama4_stack, forward=_llama4_forward,
        state=_llama4_state,
        why="every expert over every token (bmm), inputs scaled by a dense scatter of the "
            "router's top-k"),
)


# ------------------------------------------------------------------------ transformers DBRX

def _dbrx_stack(block: nn.Module) -> StackedExperts:
    """``DbrxExperts``: each expert's ``w1`` (gate), ``v1`` (up), ``w2`` are ``[F, H]`` rows
    of ``[E*F, H]`` parameters; ``DbrxExpertGLU`` computes ``(act(x w1^T) * x v1^T) w2``, so
    gate and up concatenate to ``[E, 2F, H]`` and the down projection is ``w2^T [E, H, F]``
    (copies, carried by the program)."""
    glu = block.mlp
    act = expert_activation(glu.activation_fn)
    if act is None:
        raise DCPTransformError(
            f"DbrxExperts' activation {type(glu.activation_fn).__name__} is not one dcp.moe "
            f"computes ({sorted(a.value for a in set(hf_expert_activations().values()))}). "
            f"Use ffn_config.ffn_act_fn={{'name': 'silu'}}.")
    shape = (block.num_experts, block.ffn_hidden_size, block.hidden_size)
    gate_up = torch.cat([glu.w1.view(shape), glu.v1.view(shape)], dim=1)
    return StackedExperts(gate_up, glu.w2.view(shape).transpose(1, 2).contiguous(),
                          activation=act.value)


def _dbrx_forward(block: nn.Module, stacked: StackedExperts) -> Callable:
    """``DbrxExperts.forward`` (transformers 5.25): its loop over the hit experts (``nonzero``,
    ``torch.where``: data-dependent token counts) computes, for each token, the sum over its
    top-k of the routing weight times the expert's GLU, which is dcp.moe. The router and
    its top-k / p-norm (``DbrxFFN.route_tokens_to_experts``) stay the model's own."""

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        batch_size = hidden_states.shape[0]
        x = hidden_states.reshape(-1, block.hidden_size)
        return stacked.moe(x, top_k_index, top_k_weights).view(batch_size, -1,
                                                                block.hidden_size)
    return forward


_DBRX = "transformers.models.dbrx.modeling_dbrx"
RULES = RULES + (
    ExpertsRule(
        block=f"{_DBRX}:DbrxExperts", library="transformers 5.25 (DBRX)",
        pinned={f"{_DBRX}:DbrxExperts.forward": {"acae1549e65b"},
                f"{_DBRX}:DbrxExpertGLU.forward": {"d4dac21b0aac"}},
        parts=lambda block: [block.mlp], stack=_dbrx_stack, forward=_dbrx_forward,
        replaced=lambda block: block.mlp,
        why="a loop over the experts the batch hits (nonzero, torch.where: data-dependent "
            "token counts)"),
)


# --------------------------------------------------------------------- transformers JetMoE

def _jetmoe_attention_experts(block: nn.Module) -> str:
    """JetMoE's mixture of attention heads (``JetMoeMoA``) is not an MoE MLP: why not."""
    import inspect
    fn = type(block).map
    where = f"{inspect.getsourcefile(fn)}, line {inspect.getsourcelines(fn)[1]}"
    return (f"it is JetMoE's mixture of attention heads (JetMoeMoA.map at {where}): each "
            f"token's query heads come from the top-{block.top_k} of {block.num_experts} "
            f"query-projection experts its router picks, and its output projection is routed "
            f"the same way (JetMoeMoA.reduce). dcp_compile shards attention by fixed heads "
            f"(TP) and has no form for projections routed per token; dcp.moe computes gated "
            f"MLP experts only. Not a limit of DCP (the attention itself is softmax attention "
            f"over K/V heads repeated top-k times); use a model whose attention projections "
            f"are plain linears")


_JETMOE = "transformers.models.jetmoe.modeling_jetmoe"
RULES = RULES + (
    ExpertsRule(
        block=f"{_JETMOE}:JetMoeMoA", library="transformers 5.25 (JetMoE)",
        pinned={f"{_JETMOE}:JetMoeMoA.map": {"3263d7e07180"},
                f"{_JETMOE}:JetMoeMoA.reduce": {"f8e309330b15"}},
        parts=lambda block: [], stack=None, forward=None, state=_jetmoe_attention_experts,
        why="per-token routed query and output projections (a mixture of attention heads)"),
)


def _class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def rule_of_class(module: nn.Module, rules, key: str):
    """The rule of ``rules`` whose class (its field ``key``, ``module:Class``) ``module`` is or
    derives from; None: not listed. Every module swap (experts, windows, position bias,
    indexers) finds its rule so."""
    keys = {_class_key(c) for c in type(module).__mro__}
    return next((r for r in rules if getattr(r, key) in keys), None)


def changed_pins(objects: list, pinned: dict) -> dict:
    """``pin -> the source hashes not pinned`` for each pinned function (``module:Class.fn ->
    {hash, ...}``) as ``objects`` resolve it ("missing": none does); empty: the code is the
    code the swap was written from."""
    changed = {}
    for pin, digests in pinned.items():
        got = {source_hash(fn) for fn in _pinned_sources(objects, pin)} or {"missing"}
        if not got <= digests:
            changed[pin] = sorted(got - digests)
    return changed


def rule_for(module: nn.Module) -> ExpertsRule | None:
    """The rule whose block class ``module`` is (or derives from); None: not a listed block."""
    return rule_of_class(module, RULES, "block")


def _pinned_sources(objects: list, pin: str) -> list:
    """The function ``pin`` (``module:Class.fn``) as each object of that class among
    ``objects`` resolves it (an override in a subclass is what runs, so it is what counts)."""
    cls_key, fn = pin.rsplit(".", 1)
    return [getattr(type(obj), fn) for obj in objects
            if cls_key in {_class_key(c) for c in type(obj).__mro__}]


def _definition(pin: str):
    """``module:Class.fn`` as defined (imported: the block's library is already loaded)."""
    import importlib
    module, path = pin.split(":")
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_pins(name: str, block: nn.Module, rule: ExpertsRule) -> None:
    """Refuse a block whose code is not the code the rule was written from, or that is in a
    state the swap does not read (``rule.state``)."""
    changed = changed_pins([block, *rule.parts(block)], rule.pinned)
    for pin, digest in rule.definitions.items():
        got = source_hash(_definition(pin))
        if got != digest:
            changed[pin] = got
    if changed:
        raise DCPTransformError(
            f"{name} ({type(block).__qualname__}) is {rule.library}'s MoE block, {rule.why}, "
            f"which dcp_compile reads as one dcp.moe from that version's code; here the code "
            f"differs: {changed} (source hashes). Use {rule.library}, or write the experts as "
            f"a torch.ops.dcp.moe call (docs/moe-mla.md: Mixture of experts).")
    why = rule.state(block)
    if why is not None:
        raise DCPTransformError(f"{name} ({type(block).__qualname__}), {rule.library}'s MoE "
                                f"block, cannot be read as one dcp.moe: {why}.")


def swap_sites(model: nn.Module, rule_for, check_pins) -> list[tuple[str, nn.Module, object]]:
    """Every module of ``model`` a swap lists (``rule_for``): (name, module, rule), each one's
    code checked by ``check_pins`` first. Every module swap walks the model so."""
    found = []
    for name, m in model.named_modules():
        rule = rule_for(m)
        if rule is not None:
            check_pins(name or type(m).__name__, m, rule)
            found.append((name, m, rule))
    return found


def blocks(model: nn.Module) -> list[tuple[str, nn.Module, ExpertsRule]]:
    """Every listed library MoE block of ``model``: (name, module, rule), code checked."""
    return swap_sites(model, rule_for, check_pins)


def _key(name: str) -> str:
    return name.replace(".", "__") or "root"


def _stack(name: str, block: nn.Module, rule: ExpertsRule) -> StackedExperts:
    try:
        return rule.stack(block)
    except DCPTransformError:
        raise
    except Exception as e:  # noqa: BLE001 - experts that do not stack: a refusal, named
        raise DCPTransformError(
            f"{name} ({type(block).__qualname__}), {rule.library}'s MoE block: its experts do "
            f"not stack into one [E, ...] weight per projection ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). dcp.moe needs experts of one "
            f"shape; build the block with identical experts.") from e


def stacked_experts(model: nn.Module) -> nn.ModuleDict:
    """The stacked experts of every listed block (built once; empty for other models)."""
    return nn.ModuleDict({_key(name): _stack(name, m, rule) for name, m, rule in blocks(model)})


@contextlib.contextmanager
def module_experts_enabled(model: nn.Module, stacked: nn.ModuleDict):
    """Within: every listed MoE block of ``model`` computes its experts as one dcp.moe (its
    forward swapped on the instance; the class is untouched and the swap undone on exit)."""
    swapped = []
    if not len(stacked):
        yield 0
        return
    try:
        for name, m, rule in blocks(model):
            if _key(name) not in stacked:
                raise DCPTransformError(
                    f"{name} ({type(m).__qualname__}) became {rule.library}'s MoE block after "
                    f"the model was prepared for capture. Transform the model as it is.")
            m.forward = rule.forward(m, stacked[_key(name)])
            swapped.append(m)
        yield len(swapped)
    finally:
        for m in swapped:
            del m.forward


def drop_replaced_weights(captured, step_module: nn.Module, model: nn.Module) -> int:
    """Remove from a capture the weight inputs of the experts the swap replaced (litgpt's
    per-expert linears, torchtitan's fp32 w1/w2/w3, the second name Llama-4's own stacked
    weights get through ``StackedExperts``): torch.export lifts every parameter of the
    module, used or not, and a program would carry them to every rank unread. Only inputs
    no node reads are removed."""
    replaced = {id(t) for _, m, rule in blocks(model) for t in rule.replaced(m).parameters()}
    if not replaced:
        return 0
    dropped = 0
    for n in list(captured.gm.graph.nodes):
        fqn = captured.params.get(n.name)
        if n.op == "placeholder" and fqn is not None and not n.users and \
                id(step_module.get_parameter(fqn)) in replaced:
            captured.gm.graph.erase_node(n)
            del captured.params[n.name]
            dropped += 1
    if dropped:
        captured.gm.recompile()
    return dropped

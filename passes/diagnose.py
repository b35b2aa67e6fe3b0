"""Name the feature behind a refusal: what the captured code computes that DCP does not.

When the compiler refuses a model because it finds no attention it recognises (or an
attention it cannot rewrite), the real reason is usually a feature of the model: ALiBi
biases, attention sinks, SSM or linear-attention layers. The graph knows:
every node carries the stack of the code that made it (``stack_trace``) and the modules it
ran in (``nn_module_stack``). ``features_in(gm)`` reads that evidence against ``FEATURES``
(data: a feature, why DCP cannot take it, and the code names that show it) and returns what
it found, with the module and source line of the first node that shows each feature. It
only adds facts to an error message; it never decides what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch.fx import GraphModule, Node


@dataclass(frozen=True)
class Feature:
    name: str         # what users call it
    why: str          # why the DCP program cannot compute it
    pattern: str      # code names (function, module class, parameter) that show it


FEATURES = (
    Feature("ALiBi", "its attention scores add per-head linear position biases in a form "
            "the attention recognisers do not read (slope_h * (k_pos - q_pos), up to a "
            "per-query constant, added to the eager scores or to their additive mask, is "
            "supported: docs/guarantees.md)", r"alibi"),
    Feature("attention sinks", "a learned sink logit joins each softmax denominator in a form "
            "the attention recognisers do not read (gpt-oss's one logit per q head, cat'ed "
            "to the scores or as s_aux, is supported)", r"\bsinks?\b|s_aux"),
    Feature("SSM / linear-attention layers", "some layers carry a recurrent state instead of a "
            "KV cache, and no rule runs this one as a dcp op (the mixers of docs/hybrid.md "
            "do: their code is not counted here)",
            # conv1d: torch's Conv1d / conv1d (a short convolution over the sequence), not
            # transformers' Conv1D (GPT-2's linear with a transposed weight): case-sensitive d
            r"mamba|selective_scan|\bssm\b|ssm_|(?-i:[Cc]onv1d)|short_?conv|linear_?attn|"
            r"linearattention|gated_?delta|deltanet|rwkv|recurrent|xlstm|mlstm|slstm"),
)


def _evidence(node: Node) -> str:
    """The code names a node was made under: its module stack and its stack trace."""
    stack = node.meta.get("nn_module_stack") or {}
    parts = [f"{path} {getattr(cls, '__name__', cls)}" for path, cls in stack.values()]
    parts.append(node.meta.get("stack_trace") or "")
    if node.op in ("get_attr", "placeholder"):
        parts.append(str(node.target))
    return "\n".join(parts)


def _where(node: Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = next((t.strip() for t in reversed(trace) if t.strip().startswith("File ")), "")
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else ""
    return ", ".join(x for x in (module, line) if x) or node.name


def _handled(gm: GraphModule):
    """Whether a node is code of a recurrent mixer the graph runs as a ``dcp`` op (the
    hybrid frontend's swap, docs/hybrid.md): under that op's module, or its weights."""
    from .op_classes import RECURRENT_OPS
    paths = set()
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if n.op == "call_function" and n.target in RECURRENT_OPS and stack:
            paths.add(next(reversed(stack.values()))[0])
    flat = {p.replace(".", "_") for p in paths}

    def handled(n: Node) -> bool:
        stack = n.meta.get("nn_module_stack") or {}
        return any(path in paths for path, _ in stack.values()) or \
            (n.op == "placeholder" and any(f in n.name for f in flat))
    return handled


def features_in(gm: GraphModule) -> list[tuple[Feature, str]]:
    """Each feature of ``FEATURES`` the graph shows, with where it first shows."""
    found = []
    handled = _handled(gm)
    for feature in FEATURES:
        pattern = re.compile(feature.pattern, re.IGNORECASE)
        node = next((n for n in gm.graph.nodes
                     if not handled(n) and pattern.search(_evidence(n))), None)
        if node is not None:
            found.append((feature, _where(node)))
    return found


def explain(gm: GraphModule) -> str:
    """A sentence for an error message: the features found and why each is refused, or ""."""
    found = features_in(gm)
    if not found:
        return ""
    return " ".join(f"The model uses {f.name} ({where}): {f.why}." for f, where in found)

"""The diagnosis names a refusal's feature from the code names a node was made under
(``passes/diagnose.FEATURES``). transformers' ``Conv1D`` (GPT-2, GPT-SW3, OpenAI-GPT: a linear
whose weight is stored [in, out]) is not a convolution: it must not read as an SSM's short
convolution, which torch's ``Conv1d`` / ``conv1d`` is."""

import pytest
import torch
from torch.fx import symbolic_trace

from dcp_compile.passes.diagnose import features_in


def _graph_under(module_path: str, cls_name: str):
    gm = symbolic_trace(lambda x: torch.relu(x))
    cls = type(cls_name, (torch.nn.Module,), {})
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["nn_module_stack"] = {"m": (module_path, cls)}
    return gm


@pytest.mark.parametrize("path,cls,ssm", [
    ("transformer.h.0.attn.c_attn", "Conv1D", False),    # transformers' transposed linear
    ("backbone.layers.0.mixer.conv1d", "Conv1d", True),    # Mamba's short convolution
    ("model.layers.0.conv", "Conv1d", True),               # torch.nn.Conv1d by its class
    ("model.layers.0.short_conv", "ShortConv", True),
], ids=["hf-conv1d-linear", "mamba-conv1d", "torch-conv1d-class", "short-conv"])
def test_conv1d_names_a_convolution_not_transformers_linear(path, cls, ssm):
    names = [f.name for f, _ in features_in(_graph_under(path, cls))]
    assert ("SSM / linear-attention layers" in names) is ssm, names

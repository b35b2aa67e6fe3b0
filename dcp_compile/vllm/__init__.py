"""dcp_compile as a vLLM general plugin: vLLM's scheduler, KV cache and server, the DCP
program as the model step (docs/vllm.md).

``register()`` is the entry point (group ``vllm.general_plugins``, in pyproject.toml); vLLM
calls it in every process. It registers the model class ``DcpCompiledForCausalLM`` (chosen
with ``hf_overrides={"architectures": ["DcpCompiledForCausalLM"]}``) and the stub attention
backend. Nothing here is imported unless vLLM is installed (the ``vllm`` extra).
"""

from __future__ import annotations

ARCHITECTURE = "DcpCompiledForCausalLM"
HF_OVERRIDES = {"architectures": [ARCHITECTURE]}


def register() -> None:
    """Register the model class and the attention backend with vLLM (idempotent: vLLM may
    load plugins more than once per process)."""
    from vllm import ModelRegistry

    from dcp_compile.vllm.attention import register_backend
    register_backend()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE,
                                     "dcp_compile.vllm.model:DcpCompiledForCausalLM")

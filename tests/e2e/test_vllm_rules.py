"""vLLM's DCP rule for GQA/MQA (``tensor_parallel_size`` > the model's KV heads) is honoured,
not lifted: vLLM refuses the layout before the plugin runs, with its own message, and the
program's DCPConfig has the same rule (decode DCP replicates each KV head over its DCP
group), so the plugin would refuse it too (docs/vllm.md "vLLM's DCP rules")."""

from __future__ import annotations

import pytest

from vllm_env import LLM_ARGS, run_offline, write_checkpoint

pytestmark = pytest.mark.multiprocess


def test_tp_not_above_kv_heads_is_refused_by_vllm_and_by_the_program(tmp_path):
    import dcp_compile
    from dcp_compile.meta_init import meta_model
    from dcp_compile.runtime.errors import DCPConfigError
    from dcp_compile.models.tiny_llama import write_tiny_llama

    two_kv = write_tiny_llama(tmp_path / "kv2", num_kv_heads=2)
    one_kv = write_checkpoint(tmp_path / "kv1")
    args = {k: v for k, v in LLM_ARGS.items() if k != "distributed_executor_backend"}
    refused, accepted = run_offline({"config_only": [dict(args, model=str(two_kv)),
                                                     dict(args, model=str(one_kv))]},
                                    tmp_path)["config_errors"]
    assert "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (2) " \
           "to be greater than the model's total number of KV heads (2)" in refused
    assert accepted is None
    with pytest.raises(DCPConfigError, match=r"decode DCP needs tp > num_kv_heads .*tp=2, "
                                             r"num_kv_heads=2"):
        dcp_compile.transform(meta_model(two_kv), tp=2, dcp=2, check=False)

"""The configurable garbage block (runtime/garbage_block.py): last (our engine) or first
(vLLM's null block), through the write op, both attention kernels, the step contract, the
allocator, the config and program files. Numerics with the block first run in
tests/passes/test_decode_dcp.py and tests/passes/test_prefill_dcp.py (ids ``garbage-first``)."""

import pytest
import torch

import dcp_compile
import dcp_compile.runtime.kernels.ops  # noqa: F401  (registers torch.ops.dcp.*)
from dcp_compile.models.demo import DemoConfig, demo_model
from dcp_compile.runtime.config import DCPConfig
from dcp_compile.runtime.errors import DCPConfigError, DCPInputError
from dcp_compile.runtime.garbage_block import garbage_block_id, usable_blocks
from dcp_compile.runtime.kernels.live_attention import live_partial_attention
from dcp_compile.runtime.program.program_file import load_program
from dcp_compile.runtime.serving.kv_cache import BlockAllocator
from dcp_compile.runtime.serving.metadata import compute_slot_mapping
from dcp_compile.runtime.serving.step_contract import StepContract

ops = torch.ops.dcp
GARBAGE = [pytest.param(-1, 3, id="last"), pytest.param(0, 0, id="first")]


def _cache(blocks=4, block=4, fill=0.0):
    return torch.full((blocks, block, 1, 2), fill)


@pytest.mark.parametrize("garbage,block_id", GARBAGE)
def test_the_garbage_block_id(garbage, block_id):
    assert garbage_block_id(4, garbage) == block_id
    assert block_id not in usable_blocks(4, garbage) and len(usable_blocks(4, garbage)) == 3


@pytest.mark.parametrize("garbage,block_id", GARBAGE)
@pytest.mark.parametrize("in_place", [False, True], ids=["functional", "in-place"])
def test_masked_and_out_of_range_writes_land_in_the_garbage_block_only(garbage, block_id,
                                                                       in_place):
    kc, vc = _cache(fill=float("nan")), _cache(fill=float("nan"))
    k = torch.arange(5.0).reshape(1, 5, 1, 1).expand(1, 5, 1, 2).contiguous()
    usable = 5 if garbage == 0 else 1                   # a row of a usable block
    slots = torch.tensor([[usable, -1, block_id * 4 + 2, 16, 2 ** 40]])
    if in_place:
        ops.cache_write_(kc, vc, k, k, slots, garbage_block=garbage)
        new_k = kc
    else:
        new_k, _ = ops.cache_write(kc, vc, k, k, slots, garbage_block=garbage)
    written = torch.isfinite(new_k).all(-1).all(-1)     # [blocks, block]
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[usable // 4, usable % 4] = True
    expected[block_id, 0] = True                        # every masked write: garbage row 0
    assert torch.equal(written, expected)


@pytest.mark.parametrize("garbage,block_id", GARBAGE)
@pytest.mark.parametrize("kernel", ["reference", "live"])
def test_attention_never_reads_the_garbage_block(garbage, block_id, kernel):
    """An entry naming the garbage block is masked (its NaN never reaches the output); a
    usable block is read."""
    kc, vc = _cache(), _cache()
    mine = 2 if garbage == 0 else 1
    kc[mine], vc[mine] = 0.1, 2.0
    kc[block_id], vc[block_id] = float("nan"), float("nan")
    q, cur = torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)
    args = (q, torch.tensor([[8]]), cur, cur, torch.tensor([[-1]]), kc, vc,
            torch.tensor([[block_id, mine]]), torch.tensor([8]), torch.tensor(0), 1, 4, 1.0)
    if kernel == "reference":
        out, lse = ops.partial_attention(*args, garbage_block=garbage)
    else:
        out, lse = live_partial_attention(*args, garbage_block=garbage)
    assert torch.allclose(out, torch.full_like(out, 2.0)) and torch.isfinite(lse).all()


def test_the_step_contract_and_slot_mapping_refuse_the_first_block_when_it_is_garbage():
    contract = StepContract(num_blocks=4, garbage_block=0, rules=("block-id-range",
                                                                  "garbage-block"))
    contract.check(None, torch.tensor([[0]]), torch.tensor([[3]]))     # block 3 is usable
    with pytest.raises(DCPInputError, match=r"= 0 is the garbage block.*Use blocks \[1, 3\]"):
        contract.check(None, torch.tensor([[0]]), torch.tensor([[0]]))
    with pytest.raises(DCPInputError, match="garbage block"):
        compute_slot_mapping([[0]], [[0]], 0, 1, 4, 4, num_blocks=4, garbage_block=0)
    assert compute_slot_mapping([[3]], [[1]], 0, 1, 4, 4, num_blocks=4,
                                garbage_block=0).tolist() == [[13]]


def test_the_allocator_never_hands_out_the_first_block_when_it_is_garbage():
    alloc = BlockAllocator(4, 4, garbage_block=0)
    assert alloc.garbage_block == 0
    assert alloc.ensure(0, 12) == [1, 2, 3]
    with pytest.raises(DCPInputError, match="out of KV cache blocks"):
        alloc.ensure(1, 1)


@pytest.mark.parametrize("bad", [1, -2, True, "first"])
def test_other_garbage_blocks_are_refused_by_name(bad):
    with pytest.raises(DCPConfigError, match=r"garbage_block must be -1 .* or 0 .*Pass -1 or 0"):
        DCPConfig(tp=2, dcp=2, garbage_block=bad)
    with pytest.raises(DCPConfigError, match="garbage_block"):
        BlockAllocator(4, 4, garbage_block=bad)


def test_a_program_keeps_its_garbage_block_through_a_program_file(tmp_path):
    model = demo_model(DemoConfig(num_layers=1, num_kv_heads=1))
    program = dcp_compile.transform(model, tp=2, dcp=2, check=False, garbage_block=0)
    writes = [n for n in program.graphs["decode"].graph.nodes
              if n.target is ops.cache_write.default]
    assert writes and all(n.kwargs == {"garbage_block": 0} for n in writes)
    program.save(tmp_path / "p.dcp")
    loaded = load_program(tmp_path / "p.dcp")
    assert loaded.config.garbage_block == 0 and loaded.cache_spec().garbage_block == 0
    assert StepContract.for_program(loaded, "decode").garbage_block == 0

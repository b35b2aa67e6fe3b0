"""Hybrid models' recurrent mixers as ``dcp.gated_delta_net`` with an explicit state cache
(dcp_compile/frontends/module_recurrent.py, runtime/kernels/recurrent.py): the swapped
mixer computes what the model's own module computes (fp32, 1e-4), chunk by chunk with the
state carried in its slot, padding rows touch only the garbage slot, and what is not done
is refused by name."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.frontends import module_recurrent as mr
from dcp_compile.frontends.module_recurrent import (allocate_states, recurrent_as_ops,
                                                    recurrent_layers, refuse_hybrid)
from dcp_compile.runtime.errors import DCPHybridError
from dcp_compile.runtime.kernels.recurrent import garbage_state_slot, state_rows
from full_runs import full
from hybrid_configs import ATTENDING_KINDS, HYBRID_TYPES, NON_RECURRENT_KINDS, build_hybrid

TOL = 1e-4


@pytest.fixture(scope="module", params=HYBRID_TYPES)
def model(request):
    torch.manual_seed(0)
    return build_hybrid(request.param)


def _mixer(model):
    return recurrent_layers(model)[0][1]


def test_every_recurrent_layer_is_found(model):
    kinds = model.config.layer_types
    layers = recurrent_layers(model)
    assert [m.layer_idx for _, m, _ in layers] == [i for i, k in enumerate(kinds)
                                                   if k not in NON_RECURRENT_KINDS]


# Mixed prompt lengths around the conv kernel K=4 (3, 4, 5) and an 8, right-padded in one batch.
LENGTHS = [1, 3, 4, 5, 8]


@torch.no_grad()
def test_whole_model_matches_its_own_forward(model):
    """Each row of a mixed-length batch (right-padded, lengths left to the op) matches the
    model's own forward on that row alone, at every real position; greedy tokens equal."""
    gen = torch.Generator().manual_seed(1)
    S = max(LENGTHS)
    ids = torch.randint(0, model.config.vocab_size, (len(LENGTHS), S), generator=gen)
    states = allocate_states(model, num_slots=len(LENGTHS))
    states.step(list(range(len(LENGTHS))), [True] * len(LENGTHS), LENGTHS)
    with recurrent_as_ops(model, states):
        got = model(ids, use_cache=False).logits
    for layer, conv in states.conv.items():   # the op ran: every row's slot holds a state
        assert all(conv[b].abs().max() > 0 for b in range(len(LENGTHS))), layer
    for b, n in enumerate(LENGTHS):
        want = model(ids[b:b + 1, :n], use_cache=False).logits[0]
        err = (got[b, :n] - want).abs().max().item()
        assert err < TOL, f"row {b} (len={n}): max error {err}"
        assert torch.equal(got[b, :n].argmax(-1), want.argmax(-1))


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[8], [3, 5], [1, 1, 1, 1, 4], [4, 4]],
                         ids=["whole", "3+5", "decode-steps", "4+4"])
def test_mixer_chunks_carry_the_state(model, chunks):
    """The mixer over a sequence split into chunks (state carried in the row's slot, rows of
    different lengths, padding after each row's real tokens) equals the module's own forward
    over the whole sequence."""
    m = _mixer(model)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([8, 5, 3])
    B, S, H = 3, 8, model.config.hidden_size
    x = torch.randn(B, S, H, generator=gen)
    want = [m(x[b:b + 1, :n]) for b, n in enumerate(lengths.tolist())]   # the module's own
    states = allocate_states(model, num_slots=4)
    slots = [2, 0, 3]
    outs, start = [], torch.zeros(B, dtype=torch.int64)
    with recurrent_as_ops(model, states):
        for c in chunks:
            n = (lengths - start).clamp(min=0, max=c)
            chunk = torch.zeros(B, c, H)
            for b in range(B):
                chunk[b, :n[b]] = x[b, start[b]:start[b] + n[b]]
            states.step(slots, start == 0, n)
            out = m(chunk)
            outs.append([out[b, :n[b]] for b in range(B)])
            start = start + n
    for b in range(B):
        got = torch.cat([o[b] for o in outs])
        err = (got - want[b][0]).abs().max().item()
        assert err < TOL, f"row {b} (len={lengths[b]}), chunks {chunks}: max error {err}"
    # slot 1 was given to no row: still zeros
    layer = m.layer_idx
    assert all(d[layer][1].abs().max() == 0 for d in (states.conv, states.rec) if layer in d)


@torch.no_grad()
def test_padding_rows_write_only_the_garbage_slot(model):
    """A row with slot -1 (padding) or a slot outside the cache writes the garbage slot; every
    other slot keeps its bytes; a fresh row reads zeros whatever its slot held."""
    m = _mixer(model)
    states = allocate_states(model, num_slots=3)
    layer = m.layer_idx
    gen = torch.Generator().manual_seed(3)
    caches = [d for d in (states.conv, states.rec) if layer in d]
    for d in caches:
        d[layer] = torch.randn(d[layer].shape, generator=gen)
    before = [d[layer].clone() for d in caches]
    x = torch.randn(3, 2, model.config.hidden_size, generator=gen)
    states.step([1, -1, 7], [False, False, False], [2, 2, 2])
    with recurrent_as_ops(model, states):
        m(x)
    g = garbage_state_slot(states.conv[layer])
    for d, old in zip(caches, before):
        for slot in (0, 2):
            assert torch.equal(d[layer][slot], old[slot])
        assert not torch.equal(d[layer][1], old[1])
        assert not torch.equal(d[layer][g], old[g])
    assert state_rows(states.conv[layer], torch.tensor([1, -1, 7])).tolist() == [1, g, g]
    # fresh: the row's slot holds garbage from a finished sequence; it reads zeros
    states.step([1], [True], [2])
    with recurrent_as_ops(model, states):
        got = m(x[:1])
    assert (got - m(x[:1])).abs().max() < TOL


def test_a_changed_mixer_source_is_refused(model, monkeypatch):
    rule = recurrent_layers(model)[0][2]
    name = next(iter(rule.pinned))
    changed = mr.RecurrentRule(rule.module, rule.cls, {**rule.pinned, name: "0" * 12},
                               rule.state, rule.forward)
    monkeypatch.setattr(mr, "RULES", tuple(changed if r is rule else r for r in mr.RULES))
    with pytest.raises(DCPHybridError, match=rf"{rule.cls}.*source of {name}"):
        with recurrent_as_ops(model, allocate_states(model, 1)):
            pass
    assert "forward" not in vars(_mixer(model))   # the swap was undone


def test_an_unknown_conv_activation_is_refused_by_name(model, monkeypatch):
    name, m, rule = recurrent_layers(model)[0]
    if not hasattr(m, "activation"):
        pytest.skip(f"{rule.cls}'s convolution has no activation")
    monkeypatch.setattr(m, "activation", "gelu")
    with pytest.raises(DCPHybridError, match=rf"{rule.cls} at {name}: .*'gelu'"):
        with recurrent_as_ops(model, allocate_states(model, 1)):
            pass


def test_what_is_not_done_is_refused_by_name(model):
    with pytest.raises(DCPHybridError, match=r"prefix caching.*vblock.*Turn prefix caching off"):
        refuse_hybrid(model, prefix_caching=True)


def test_a_mixer_known_by_name_is_refused_naming_what_it_needs(monkeypatch):
    """A hybrid whose mixer is known by name but has no op (``NOT_BUILT``; RecurrentGemma's
    RG-LRU was, until dcp.rg_lru: here its rule is taken away again): transform() names it
    and what it needs, not the list of every module whose name looks recurrent."""
    import dcp_compile
    from hf_corpus import build
    from dcp_compile.runtime.serving.engine import StepShapes
    monkeypatch.setattr(mr, "RULES", tuple(r for r in mr.RULES
                                           if r.cls != "RecurrentGemmaRecurrentBlock"))
    monkeypatch.setitem(mr.NOT_BUILT, "RecurrentGemmaRglru", "its RG-LRU needs dcp.rg_lru")
    with pytest.raises(DCPHybridError, match=r"its RG-LRU needs dcp.rg_lru. Serve this model "
                                             r"without DCP") as e:
        dcp_compile.transform(build("recurrent_gemma", "sdpa"), tp=4, dcp=2, mode="decode",
                              shapes=StepShapes(batch=2, context_len=8, max_blocks=4,
                                                num_blocks=10))
    assert "no swap rule" not in str(e.value)


def test_a_model_without_recurrent_layers_is_not_refused():
    from hf_corpus import build
    refuse_hybrid(build("qwen3", "sdpa"), prefix_caching=True)


def test_a_decode_of_a_hybrid_is_not_refused(model):
    """A DCP program of a hybrid is built (frontends/hybrid.py; tests/frontends/
    test_hybrid_program.py runs it, test_hybrid_hspec.py its width-K speculative steps):
    only what is not built is refused."""
    refuse_hybrid(model)


def test_declared_windows_of_the_graph_count_attention_layers_only(model):
    """The config's per-layer lists cover every decoder layer; the captured graph has an
    attention site for the attention layers only, so the windows InsertPagedCache checks
    against those sites (attention_windows) leave the recurrent layers out, in layer order,
    while declared_windows stays indexed by layer_idx (the attention call's)."""
    from dcp_compile.frontends.hf_config import attention_windows, declared_windows
    kinds = model.config.layer_types
    attention = [i for i, k in enumerate(kinds) if k in ATTENDING_KINDS]
    per_layer = declared_windows(model)
    assert len(per_layer) == model.config.num_hidden_layers
    assert attention_windows(model) == [per_layer[i] for i in attention]
    assert 0 < len(attention) <= model.config.num_hidden_layers


class _StateStep(torch.nn.Module):
    """The model behind a step signature with its state caches as inputs and outputs:
    ``(ids, slot, fresh, lengths, conv, rec) -> (logits, conv', rec')`` (the hybrid
    frontend's HybridStep takes the same, behind the paged step's inputs)."""

    def __init__(self, model, conv_layers, rec_layers):
        super().__init__()
        self.model, self.conv_layers, self.rec_layers = model, conv_layers, rec_layers

    def forward(self, ids, slot, fresh, lengths, conv, rec):
        states = mr.RecurrentStates(dict(zip(self.conv_layers, conv)),
                                    dict(zip(self.rec_layers, rec)), slot, fresh, lengths)
        with recurrent_as_ops(self.model, states):
            logits = self.model(ids, use_cache=False).logits
        return (logits, [states.conv[i] for i in self.conv_layers],
                [states.rec[i] for i in self.rec_layers])


# The export's slice: one type per swap (module_recurrent.RULES): qwen3_next's and qwen3_5's
# Gated DeltaNet heads, Mamba2, the short conv. DCP_HYBRID_EXPORT_FULL=1 adds the MoE
# siblings, whose mixer source and swap are their dense sibling's (the module's other tests
# run every type).
EXPORT_TYPES = (HYBRID_TYPES if full("DCP_HYBRID_EXPORT_FULL")
                else ("qwen3_next", "qwen3_5_text", "bamba", "lfm2"))


@torch.no_grad()
@pytest.mark.parametrize("model", EXPORT_TYPES, indirect=True)
def test_the_swap_exports_with_its_states_as_inputs(model):
    """torch.export of the swapped model (the capture a hybrid program takes): one
    recurrent op per recurrent layer, the state caches as graph inputs and outputs; the
    exported program on a right-padded batch of lengths 5 and 8 gives each row the model's
    own logits (1e-4, greedy tokens equal) and the states the eager swap leaves."""
    lengths = [5, 8]
    states = allocate_states(model, num_slots=2)
    conv_layers, rec_layers = sorted(states.conv), sorted(states.rec)
    step = _StateStep(model, conv_layers, rec_layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 8),
                        generator=torch.Generator().manual_seed(2))
    args = (ids, torch.tensor([1, 0]), torch.tensor([True, True]), torch.tensor(lengths),
            [states.conv[i] for i in conv_layers], [states.rec[i] for i in rec_layers])
    ep = torch.export.export(step, args, strict=False)
    ops = [n for n in ep.graph.nodes if str(n.target).startswith("dcp.")]
    assert len(ops) == len(recurrent_layers(model))
    logits, conv, rec = ep.module()(*args)
    for b, n in enumerate(lengths):
        want = model(ids[b:b + 1, :n], use_cache=False).logits[0]
        assert (logits[b, :n] - want).abs().max() < TOL, b
        assert torch.equal(logits[b, :n].argmax(-1), want.argmax(-1))
    eager = allocate_states(model, num_slots=2).step([1, 0], [True, True], lengths)
    with recurrent_as_ops(model, eager):
        model(ids, use_cache=False)
    for got, layers, want in ((conv, conv_layers, eager.conv), (rec, rec_layers, eager.rec)):
        for t, layer in zip(got, layers):
            assert t.abs().max() > 0 and torch.equal(t, want[layer]), layer

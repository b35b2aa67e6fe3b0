"""Linears run whole by their module (``passes/placement/whole.py``, ``WHOLE_LINEARS``): a
hyper-connection's stream mix (HY-V4's ``F.linear(flat, self.fn)``: ``[hc * hidden] ->
2 * hc`` weights per token) feeds no projection the sweeps know, so without its row the
analysis takes the next linear for an MLP down projection and refuses; with it, the mix
runs whole and the model is its own forward in decode and prefill (where sequence
parallelism passes the mix's split and the streams' ``expand(-1, -1, hc, -1)``).
The real model: tests/frontends/test_dsa_transform.py's HY-V4 cells."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_corpus as C

from dcp_compile.passes.placement import whole

HC, H, HEADS, KV = 2, 32, 8, 2


class StreamMix(nn.Module):
    """HY-V4's hyper-connection in small: pre / post weights per token from all streams."""

    def __init__(self):
        super().__init__()
        self.fn = nn.Parameter(torch.randn(2 * HC, HC * H) * 0.1)

    def forward(self, streams):
        flat = streams.flatten(2)
        mixes = F.linear(flat, self.fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
        pre, post = mixes.split(HC, dim=-1)
        out = (torch.sigmoid(pre).unsqueeze(-1) * streams).sum(dim=2)
        return 2 * torch.sigmoid(post), out


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_hc, self.ffn_hc = StreamMix(), StreamMix()
        self.qkv = nn.Linear(H, (HEADS + 2 * KV) * 4, bias=False)
        self.o = nn.Linear(HEADS * 4, H, bias=False)
        self.up = nn.Linear(H, 48, bias=False)
        self.down = nn.Linear(48, H, bias=False)

    def forward(self, streams):
        b, s = streams.shape[:2]
        post, x = self.attn_hc(streams)
        q, k, v = self.qkv(x).split([HEADS * 4, KV * 4, KV * 4], -1)
        q, k, v = (t.view(b, s, -1, 4).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = self.o(a.transpose(1, 2).reshape(b, s, -1))
        streams = post.unsqueeze(-1) * y.unsqueeze(-2) + streams
        post, x = self.ffn_hc(streams)
        return post.unsqueeze(-1) * self.down(F.gelu(self.up(x))).unsqueeze(-2) + streams


class HyperModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(C.TINY["vocab_size"], H)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head_fn = nn.Linear(HC * H, HC, bias=False)   # no mix module: not listed
        self.head = nn.Linear(H, C.TINY["vocab_size"], bias=False)

    def forward(self, input_ids):
        streams = self.embed(input_ids).unsqueeze(2).expand(-1, -1, HC, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams)
        return self.head(streams.mean(2))


KEY = f"{StreamMix.__module__}.{StreamMix.__qualname__}"


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_listed_stream_mix_runs_whole(mode, monkeypatch):
    monkeypatch.setitem(whole.WHOLE_LINEARS, KEY, "the test's stream mix")
    out = C.run_model(HyperModel().eval(), mode, logits_of=lambda m, ids: m(ids))
    assert out.kind == "matches", (out.reason, out.message[:500])


def test_an_unlisted_stream_mix_is_refused():
    """Without the row: the mix's [hc * hidden] input is cut as an MLP down projection's
    (over full TP) and the placement refuses, naming the stream mix's code."""
    out = C.run_model(HyperModel().eval(), "decode", logits_of=lambda m, ids: m(ids))
    assert out.kind == "refused", (out.kind, out.message[:500])
    assert f"Shard(dim=2, [{HC * H}/4], mlp)" in out.message, out.message[:500]
    assert "test_placement_whole.py" in out.message

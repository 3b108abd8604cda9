"""A small GPT (tied embedding/head, causal-mask buffer sliced by the sequence length)."""

from __future__ import annotations

import math

import pytest
import torch
from capture_compare import assert_same, grads_of

from stoker_capture import aot_module


class Block(torch.nn.Module):
    def __init__(s, d=16, h=2, T=32):
        super().__init__()
        s.ln1 = torch.nn.LayerNorm(d)
        s.qkv = torch.nn.Linear(d, 3 * d)
        s.proj = torch.nn.Linear(d, d)
        s.ln2 = torch.nn.LayerNorm(d)
        s.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )
        s.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))
        s.h = h

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, dim=2)
        q = q.view(B, T, s.h, C // s.h).transpose(1, 2)
        k = k.view(B, T, s.h, C // s.h).transpose(1, 2)
        v = v.view(B, T, s.h, C // s.h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(s.mask[:, :, :T, :T] == 0, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + s.proj(y)
        return x + s.mlp(s.ln2(x))


class GPT(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = torch.nn.Embedding(50, 16)
        s.pos = torch.nn.Parameter(torch.randn(32, 16) * 0.02)
        s.blocks = torch.nn.ModuleList([Block()])
        s.ln = torch.nn.LayerNorm(16)
        s.head = torch.nn.Linear(16, 50, bias=False)
        s.head.weight = s.emb.weight

    def forward(s, idx, targets):
        T = idx.shape[1]
        x = s.emb(idx) + s.pos[:T]
        for b in s.blocks:
            x = b(x)
        logits = s.head(s.ln(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, 50), targets.view(-1)), logits


@pytest.mark.slow  # ~7 s of CPU: the dynamic-length recompile traces a whole GPT block
def test_small_gpt_with_changing_sequence_length() -> None:
    torch.manual_seed(0)
    m = GPT()
    compiled = aot_module(m)
    for t in (6, 9, 7):
        idx, tgt = torch.randint(0, 50, (2, t)), torch.randint(0, 50, (2, t))
        out_c, out_e = compiled(idx, tgt), m(idx, tgt)
        assert_same(out_c, out_e, atol=1e-5, rtol=1e-4)
        params = list(m.parameters())
        assert_same(grads_of(out_c, params), grads_of(out_e, params), atol=1e-4, rtol=1e-4)
    stats = compiled.cache_stats()
    assert stats["misses"] == 2 and stats["hits"] == 1, stats  # length went symbolic once

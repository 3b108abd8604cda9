"""More model shapes through stoker.compile with Triton kernels under the
interpreter (every kernel also compiled for sm_90): SDPA attention, Conv1d +
GroupNorm, embedding + BatchNorm + in-place edits, conv + pooling, a custom
autograd.Function with a dynamic batch, CPU autocast to bfloat16, and
torch.compile(backend="stoker"). Run by test_interpret_more_models.py in a
fresh process (TRITON_INTERPRET must be set before triton is imported);
prints "<case> ok" per case, exits with the number of failures."""

import copy
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("STOKER_TRITON_CHECK_TARGETS", "cuda:90")
import torch
import torch.nn as nn
import torch.nn.functional as F

import stoker


class Attn(nn.Module):
    def __init__(s):
        super().__init__()
        s.qkv = nn.Linear(16, 48)
        s.o = nn.Linear(16, 16)
        s.ln = nn.LayerNorm(16)

    def forward(s, x):
        q, k, v = s.qkv(s.ln(x)).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + s.o(y.transpose(1, 2).reshape(x.shape))


class GN(nn.Module):
    def __init__(s):
        super().__init__()
        s.c = nn.Conv1d(4, 8, 3, padding=1)
        s.g = nn.GroupNorm(2, 8)
        s.l = nn.Linear(8, 3)

    def forward(s, x):
        return s.l(F.silu(s.g(s.c(x))).mean(-1))


class Mixed(nn.Module):
    def __init__(s):
        super().__init__()
        s.e = nn.Embedding(20, 12)
        s.l = nn.Linear(12, 12)
        s.bn = nn.BatchNorm1d(12)

    def forward(s, idx):
        h = s.e(idx).sum(1)
        h = s.bn(F.dropout(F.gelu(s.l(h)), 0.0, training=True))
        h = h.clone()
        h[:, :3] *= 2
        h.add_(1)
        return (
            torch.log_softmax(h, -1).amax(-1) + h.std(-1) + torch.where(h > 0, h, h * 0.1).sum(-1)
        )


class Pool(nn.Module):
    def __init__(s):
        super().__init__()
        s.c = nn.Conv2d(3, 4, 3)
        s.l = nn.Linear(4, 2)

    def forward(s, x):
        return s.l(F.adaptive_avg_pool2d(F.max_pool2d(F.relu(s.c(x)), 2), 1).flatten(1))


cases = [
    ("attn", Attn, lambda: (torch.randn(2, 5, 16),)),
    ("groupnorm", GN, lambda: (torch.randn(3, 4, 10),)),
    ("mixed", Mixed, lambda: (torch.randint(0, 20, (6, 4)),)),
    ("pool", Pool, lambda: (torch.randn(2, 3, 9, 9),)),
]
bad = 0
for name, cls, mk in cases:
    try:
        torch.manual_seed(0)
        m = cls()
        e = copy.deepcopy(m)
        c = stoker.compile(m, backend="interpret")
        for _ in range(2):
            args = mk()
            oc, oe = c(*args), e(*args)
            torch.testing.assert_close(oc, oe, atol=1e-4, rtol=1e-4)
            oc.float().pow(2).sum().backward()
            with stoker.autograd_enabled(False):
                oe.float().pow(2).sum().backward()
            for (n, p), q in zip(m.named_parameters(), e.parameters()):
                torch.testing.assert_close(
                    p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=lambda s, n=n: f"{n}: {s}"
                )
            for b1, b2 in zip(m.buffers(), e.buffers()):
                torch.testing.assert_close(b1, b2)
        print(name, "ok", c.stoker_report.n_kernels)
    except Exception as ex:
        bad += 1
        print(name, "FAIL", type(ex).__name__, str(ex)[:800])
    stoker.reset()


class Sq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class M(nn.Module):
    def __init__(s):
        super().__init__()
        s.l1 = nn.Linear(8, 16)
        s.l2 = nn.Linear(16, 4)

    def forward(s, x):
        h = Sq.apply(torch.tanh(s.l1(x)))
        return s.l2(h), h.argmax(-1)


def run(name, fn):
    global bad
    try:
        fn()
        print(name, "ok")
    except Exception as ex:
        bad += 1

        print(name, "FAIL", type(ex).__name__, str(ex)[:1500])
    stoker.reset()


def custom_fn_dynamic():
    torch.manual_seed(0)
    m = M()
    e = copy.deepcopy(m)
    c = stoker.compile(m, backend="interpret", dynamic=True)
    for b in (3, 5, 7):
        x = torch.randn(b, 8)
        (oc, ic), (oe, ie) = c(x), e(x)
        torch.testing.assert_close(oc, oe, atol=1e-5, rtol=1e-4)
        assert torch.equal(ic, ie)
        oc.sum().backward()
        with stoker.autograd_enabled(False):
            oe.sum().backward()
        for p, q in zip(m.parameters(), e.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)


def autocast_bf16():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    e = copy.deepcopy(m)
    c = stoker.compile(m, backend="interpret")
    x = torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        oc = c(x)
        oe = e(x)
    assert oc.dtype == oe.dtype, (oc.dtype, oe.dtype)
    torch.testing.assert_close(oc.float(), oe.float(), atol=3e-2, rtol=3e-2)
    oc.float().sum().backward()
    with stoker.autograd_enabled(False):
        oe.float().sum().backward()
    for p, q in zip(m.parameters(), e.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=5e-2, rtol=5e-2)


def torch_compile_backend():
    torch.manual_seed(0)
    m = M()
    e = copy.deepcopy(m)
    c = torch.compile(m, backend="stoker")
    x = torch.randn(4, 8)
    (oc, ic), (oe, ie) = c(x), e(x)
    torch.testing.assert_close(oc, oe, atol=1e-5, rtol=1e-4)
    assert torch.equal(ic, ie)


run("custom_fn_dynamic", custom_fn_dynamic)
run("autocast_bf16", autocast_bf16)
run("torch_compile_backend", torch_compile_backend)
sys.exit(bad)

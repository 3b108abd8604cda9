"""A boxed call frees each input after its last reader (a backward's saved tensors,
as eager's engine frees them), not when the compiled graph returns."""

import weakref

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stoker_triton import compile_graph


def _two_stages(a, w):
    h = torch.sin(a)  # a's last reader
    return torch.cos(h @ w)


def _compiled():
    a, w = torch.randn(8, 16), torch.randn(16, 4)
    gm = make_fx(_two_stages)(a, w)
    return compile_graph(gm, [a, w]), a, w


def test_boxed_call_empties_the_list_and_releases_an_input_before_the_end():
    fn, a, w = _compiled()
    src = fn.wrapper_source
    assert "args.clear()" in src, src
    name = src.split("def call(args):")[1].split("=")[0].split(",")[0].strip()
    # the first input is deleted before the extern matmul that follows its last kernel
    assert src.index(f"del {name}") < src.index("return"), src
    want = _two_stages(a, w)
    args = [a.clone(), w]
    ref = weakref.ref(args[0])
    got = fn.call_boxed(args)
    assert args == [] and ref() is None
    torch.testing.assert_close(got, want)


def test_plain_call_keeps_the_callers_tensors():
    fn, a, w = _compiled()
    want = _two_stages(a, w)
    torch.testing.assert_close(fn(a, w), want)
    torch.testing.assert_close(a.sin() @ w, torch.sin(a) @ w)  # a is intact and usable

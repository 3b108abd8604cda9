"""How the generated wrapper allocates: buffers from a per-dtype prototype, and
freed extern results and extern arguments handed to a later allocation of the
same layout when the extern op returns fresh memory."""

import re
from types import SimpleNamespace
from typing import Any

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from triton_helpers import check, device, fresh

from stoker_triton._internal.codegen import reuse
from stoker_triton._internal.codegen.wrapper import returns_fresh
from stoker_triton._internal.ir import Buffer
from stoker_triton._internal.runtime import prototype

aten = torch.ops.aten


def _matmul_chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a @ b  # an extern result, read by one kernel
    r = m.relu()  # a kernel buffer read by the next extern
    q = r @ b
    return (q.sin() * 2,)  # a kernel buffer of m's layout: takes m's or r's memory


def test_a_freed_extern_result_or_argument_is_reused_and_results_stay_right() -> None:
    a, b = torch.randn(8, 8, device=device()), torch.randn(8, 8, device=device())
    fn = check(_matmul_chain, a, b)
    src = fn.wrapper_source
    assert "# reuse" in src, src
    assert src.count("empty_strided(") == 1, src  # only relu's buffer is new
    for _ in range(2):  # a second call allocates again: no value kept from the first
        x, y = fresh([a, b])
        torch.testing.assert_close(fn(x, y)[0], _matmul_chain(x, y)[0], rtol=1e-4, atol=1e-5)


def test_only_ops_whose_schema_returns_no_alias_count_as_fresh() -> None:
    assert returns_fresh(aten.mm.default) and returns_fresh(aten.cumsum.default)
    assert returns_fresh(aten.native_layer_norm.default)  # several fresh results
    # a view's result aliases its input; an in-place op returns its argument
    assert not returns_fresh(aten.transpose.int) and not returns_fresh(aten.view.default)
    assert not returns_fresh(aten.add_.Tensor)
    assert not returns_fresh(aten.mm) and not returns_fresh(lambda x: x)  # not an overload


def test_buffer_prototypes_are_real_tensors_when_made_under_a_fake_mode() -> None:
    """A wrapper may be loaded while a compiler traces (Dynamo's fake mode is active):
    its prototypes, hence its buffers, must still be real."""
    with FakeTensorMode():
        p = prototype(torch.float16, torch.device("cpu"))
    assert not isinstance(p, FakeTensor) and p.numel() == 0
    buf = p.new_empty_strided((2, 3), (1, 2))
    assert buf.dtype == torch.float16 and buf.stride() == (1, 2) and not buf.requires_grad


def _buf(name: str, n: Any, kind: str = "kernel") -> Buffer:
    return Buffer(name, (n,), (1,), 0, torch.float32, torch.device("cpu"), kind)


def _plan(bufs: list[Buffer], order: list[str]) -> dict[str, str]:
    """`reuse.plan` over events written as "+name" (allocated) and "-name" (freed)."""
    prog = SimpleNamespace(buffers={b.name: b for b in bufs})
    evs = [reuse.Event(e[1:], e[0] == "+", i) for i, e in enumerate(order)]
    return reuse.plan(
        prog,  # type: ignore[arg-type]
        evs,
        key=lambda b: (b.size, b.stride, b.dtype),
        may_take=lambda n: True,
        may_give=lambda n: True,
    )


def test_a_freed_buffer_is_handed_over_only_where_holding_it_keeps_the_peak() -> None:
    a, b, big, c, d = _buf("a", 16), _buf("b", 16), _buf("big", 64), _buf("c", 16), _buf("d", 8)
    # a is freed, then `big` is allocated (the peak, b + big), then c: holding a over
    # `big` would raise the peak by a's bytes: c is allocated anew
    assert _plan([a, b, big, c], ["+a", "+b", "-a", "+big", "-big", "+c"]) == {}
    # b is freed after `big`: handed to c (nothing allocated in between)
    got = _plan([a, b, big, c], ["+a", "+b", "-a", "+big", "-b", "-big", "+c"])
    assert got == {"c": "b"}
    # held over a smaller allocation, below the peak: handed over
    assert _plan([a, big, c, d], ["+big", "+a", "-big", "-a", "+d", "+c"]) == {"c": "a"}
    # symbolic sizes: only when nothing is allocated between the free and the reuse
    s = sympy.Symbol("s0", positive=True, integer=True)
    sa, sb, sc, sd = _buf("a", s), _buf("b", s), _buf("c", s), _buf("d", 16)
    assert _plan([sa, sb, sc, sd], ["+a", "+b", "-a", "+c"]) == {"c": "a"}
    assert _plan([sa, sb, sc, sd], ["+a", "-a", "+d", "+c"]) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_prototype_for_a_device_not_here_allocates_when_called() -> None:
    """A graph compiled for fake CUDA inputs on a CPU machine loads its wrapper: the
    prototype stands in, and only an allocation (a call on that device) fails."""
    p = prototype(torch.float32, torch.device("cuda", 0))
    with pytest.raises((RuntimeError, AssertionError)):
        p.new_empty_strided((2,), (1,))


def _call_body(src: str) -> list[str]:
    """The lines of the generated wrapper's ``call`` function, stripped."""
    body = src[src.index("def call(args):") : src.index("no_grad = ")]
    return [ln.strip() for ln in body.splitlines()[1:] if ln.strip()]


def _cumsum_chain(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor]:
    m = a @ b  # an extern result of 8 x 8 float32
    n = aten.cumsum(m, 0)  # m freed right after this extern: nothing allocated since
    return ((n * 100).to(dtype),)  # a kernel buffer of m's size and stride


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_a_freed_buffer_is_reused_only_by_its_own_dtype(dtype: torch.dtype) -> None:
    """int32 has float32's size, stride and bytes: only the dtype tells them apart."""
    a, b = torch.randn(8, 8, device=device()), torch.randn(8, 8, device=device())
    fn = check(lambda x, y: _cumsum_chain(x, y, dtype), a, b, rtol=1e-4, atol=1e-3)
    src = fn.wrapper_source
    assert ("# reuse" in src) == (dtype == torch.float32), src
    x, y = fresh([a, b])
    (got,) = fn(x, y)
    assert got.dtype == dtype
    (want,) = _cumsum_chain(x, y, dtype)
    if dtype == torch.int32:  # a rounding of n * 100 may land on either side of an integer
        assert (got - want).abs().max() <= 1
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


_NAME = re.compile(r"\b(?:buf|arg)\d+\b")


def _ends_ok(line: str) -> bool:
    """Lines the wrapper may place between a buffer's last reader and its ``del``:
    other ``del``s and the layout check of the result just made."""
    return line.startswith("del ") or (line.startswith("if ") and "_layout(" in line)


@pytest.mark.parametrize("case", ["matmul", "cumsum"])
def test_every_buffer_is_deleted_right_after_its_last_reader(case: str) -> None:
    """A buffer (an input included) lives from its allocation to its
    last reader and not one launch or allocation longer; only the outputs outlive the
    call."""
    a, b = torch.randn(8, 8, device=device()), torch.randn(8, 8, device=device())
    f = _matmul_chain if case == "matmul" else lambda x, y: _cumsum_chain(x, y, torch.int32)
    lines = _call_body(check(f, a, b, rtol=1e-4, atol=1e-3).wrapper_source)
    returned = set(_NAME.findall(lines[-1]))
    assert lines[-1].startswith("return"), lines
    names = {n for ln in lines for n in _NAME.findall(ln)}
    assert names - returned, lines
    for name in names - returned:
        dels = [i for i, ln in enumerate(lines) if ln == f"del {name}"]
        assert len(dels) == 1, (name, lines)
        uses = [i for i, ln in enumerate(lines) if name in _NAME.findall(ln) and i != dels[0]]
        assert max(uses) < dels[0], (name, lines)  # nothing reads it after its del
        between = lines[max(uses) + 1 : dels[0]]
        assert all(_ends_ok(ln) for ln in between), (name, between)

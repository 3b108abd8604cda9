"""The lean launch path (`runtime/fastlaunch.py`): after a kernel's first launch
for a specialization, later launches call the compiled binary's launcher
directly, never `JITFunction.run`.

Triton's real launch path runs in a new process on a stand-in sm_90 driver
(`stoker_triton._internal.fakegpu`, recording what each launch passes to the
launcher). Each step reports how many times `JITFunction.run` ran, how many
binaries Triton holds, and whether the launcher got exactly what it got when
`JITFunction.run` launched the same arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from triton_helpers import run_on_fake_gpu

from stoker_triton._internal.runtime import Launcher, fastlaunch

_SCRIPT = r"""
import json, os
os.environ["TRITON_INTERPRET"] = "0"
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from stoker_triton._internal.fakegpu import install
from stoker_triton._internal.runtime import Launcher

fake = install(record=True)
runs = []
_run = JITFunction.run
JITFunction.run = lambda self, *a, **k: runs.append(1) or _run(self, *a, **k)


@triton.jit
def kernel(in_ptr, out_ptr, xnumel, rnumel, s0, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    m = x < xnumel
    tl.store(out_ptr + x, tl.load(in_ptr + x, m) * s0, m)


lau = Launcher(kernel, "sha", False, False, False)
lau.n_ptrs = 2
assert lau.fast is not None
out = {}


def addr(x):  # the lean path passes a tensor as its address, which the launcher reads it as
    return x.data_ptr() if isinstance(x, torch.Tensor) else x


def same(a, b):  # index 6, the launch metadata: only launch hooks read it, and none is set
    a, b = a[:6] + a[7:], b[:6] + b[7:]
    a, b = [addr(x) for x in a], [addr(x) for x in b]
    return len(a) == len(b) and all(x is y or (type(x) is type(y) and x == y) for x, y in zip(a, b))


def step(name, *args):
    r0 = len(runs)
    lau(*args)
    got = fake.launches[-1]
    ran = len(runs) - r0
    # the reference: Triton's own path launching the same arguments
    xb, rb, w = lau.configs[(args[2], args[3])]
    _run(kernel, *args, grid=(-(args[2] // -xb),), warmup=False, XBLOCK=xb, RBLOCK=rb, num_warps=w)
    out[name] = {
        "runs": ran,
        "binaries": len(kernel.device_caches[0][0]),
        "same_as_binder": same(fake.launches[-1], got),
        "grid": got[:3],
        "metadata": got[6] is None,
        "tail": [str(x.dtype) if isinstance(x, torch.Tensor) else x for x in got[11:]],
        "pointers": ["tensor" if isinstance(x, torch.Tensor) else type(x).__name__ for x in got[9:11]],
        "addresses": [addr(x) for x in got[9:11]] == [args[0].data_ptr(), args[1].data_ptr()],
    }


a, o = torch.randn(64), torch.empty(64)
step("first", a, o, 64, 1, 32)
step("again", a, o, 64, 1, 32)
step("other tensors", torch.randn(64), torch.empty(64), 64, 1, 48)
step("size not a multiple of 16", a, o, 64, 1, 33)
step("size 1", a, o, 64, 1, 1)
step("unaligned pointer", torch.randn(65)[1:], o, 64, 1, 32)
step("unaligned again", torch.randn(65)[1:], o, 64, 1, 32)
step("half", a.half(), o.half(), 64, 1, 32)
step("another xnumel", a, o, 48, 1, 32)
step("first again", a, o, 64, 1, 32)
# a launch hook (a profiler's) takes every launch back through the binder while it is set
from triton import knobs

hook = lambda *a, **k: None
rt = knobs.runtime
chain = rt.launch_enter_hook is not None  # Triton 3.9: a HookChain; 3.6: None or a function
rt.launch_enter_hook.add(hook) if chain else setattr(rt, "launch_enter_hook", hook)
step("hooked", a, o, 64, 1, 32)
rt.launch_enter_hook.remove(hook) if chain else setattr(rt, "launch_enter_hook", None)
step("unhooked", a, o, 64, 1, 32)
# the wrapper's path: `go` is the lean launch, given the target its graph call read once
target = lau.fast.target()
out["lean"] = lau.go is lau.lean and lau.go(target, a, o, 64, 1, 32) is True  # the kept key
# a target read while a hook is set is None: the launch takes the binder, as above
rt.launch_enter_hook.add(hook) if chain else setattr(rt, "launch_enter_hook", hook)
r0 = len(runs)
hooked_target = lau.fast.target()
lau.go(hooked_target, a, o, 64, 1, 32)
out["hooked target"] = [hooked_target is None, len(runs) - r0]
rt.launch_enter_hook.remove(hook) if chain else setattr(rt, "launch_enter_hook", None)
print("RESULT", json.dumps(out))
"""


def _steps(tmp_path: Path) -> dict[str, Any]:
    stdout = run_on_fake_gpu(tmp_path, _SCRIPT, name="fastlaunch")
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT"))
    steps: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return steps


def test_later_launches_skip_the_binder_new_specializations_do_not(tmp_path: Path) -> None:
    s = _steps(tmp_path)
    # the steady launches are one generated function (`lean_function`); a launch hook
    # sends launches through the binder while it is set, and they come back after
    assert s.pop("lean") is True
    assert s.pop("hooked target") == [True, 1]
    assert (s.pop("hooked")["runs"], s.pop("unhooked")["runs"]) == (1, 0)
    # the binder runs once per specialization, then never again for it
    binder = {name: st["runs"] for name, st in s.items()}
    assert binder == {
        "first": 1,
        "again": 0,
        "other tensors": 0,  # new addresses, same alignment; 48 is a multiple of 16 like 32
        "size not a multiple of 16": 1,
        "size 1": 1,  # Triton makes an integer equal to 1 a constant
        "unaligned pointer": 1,
        "unaligned again": 0,
        "half": 1,
        "another xnumel": 1,  # another grid (and maybe block size): its own entry
        "first again": 0,
    }, binder
    # each new specialization got its own binary from Triton (xnumel 48 reuses 64's)
    assert [s[n]["binaries"] for n in ("first", "size 1", "unaligned pointer", "half")] == [
        1,
        3,
        4,
        5,
    ]
    # the launcher got what JITFunction.run passes it: grid, stream, function,
    # metadata, no hooks, the arguments then XBLOCK and RBLOCK
    assert all(st["same_as_binder"] for st in s.values()), s
    assert s["again"]["grid"] == [1, 1, 1]
    assert s["again"]["tail"] == [64, 1, 32, 64, 1]
    # pointers: tensors through the binder, their addresses (ints) on the lean path,
    # so Triton's launcher makes no data_ptr call and no cuPointerGetAttribute per pointer
    assert s["first"]["pointers"] == ["tensor", "tensor"], s["first"]
    assert all(s[n]["pointers"] == ["int", "int"] for n in ("again", "other tensors")), s
    assert all(st["addresses"] for st in s.values()), s
    assert s["size 1"]["tail"][4] == 1
    assert s["again"]["metadata"]  # the lean path passes None where no hook reads it
    assert not s["first"]["metadata"] or triton_hooks_are_none()


def triton_hooks_are_none() -> bool:
    """Triton 3.6 keeps unset launch hooks as None (then it passes no metadata either)."""
    from triton import knobs

    return knobs.runtime.launch_enter_hook is None


def test_spec_key_separates_what_triton_specializes() -> None:
    t = torch.empty(64)
    key = fastlaunch.spec_key
    # Triton's classes: i32/i64/u64 ranges, equal to 1, multiple of 16
    assert len({key((v,)) for v in (1, 16, 17, 2**31, 2**31 + 1, 2**63, 2**63 + 1)}) == 7
    assert key((-(2**31),)) == key((0,)) and key((2**31 - 1,)) != key((2**31 + 1,))
    assert key((32,)) == key((-16,)) and key((33,)) == key((7,))
    assert key((True,)) != key((1,)) and key((1.0,)) != key((1,))
    assert key((t,)) != key((t[1:],)) and key((t,)) != key((t.half(),))
    assert key((t,)) == key((torch.empty(8),))
    assert key((None,)) is None and key((-(2**63) - 1,)) is None  # the plain path decides


def test_the_straight_line_key_never_merges_what_spec_key_separates() -> None:
    bounds = [2**31, 2**63, 2**64]
    ints = {1, 0, 15, 16, 17, 48, -1, -16}
    ints |= {b + d for b in bounds for d in (-17, -16, -1, 0, 16)} | {
        -b + d for b in bounds[:2] for d in (-16, -1, 0, 16)
    }
    ints = {v for v in ints if -(2**63) <= v < 2**64}
    t = torch.empty(64)
    keyfn = fastlaunch.key_function(4, 1)
    seen: dict[Any, Any] = {}
    for v in sorted(ints):
        for ptr in (t, t[1:], t.half()):
            args = (ptr, 64, 1, v)
            (k, launch), spec = keyfn(*args), fastlaunch.spec_key(args)
            assert launch == (ptr.data_ptr(), *args[1:]), launch
            assert seen.setdefault(k, spec) == spec, (v, k, seen[k], spec)
    assert len(set(seen.values())) == len({fastlaunch.spec_key((t, 64, 1, v)) for v in ints}) * 3
    with pytest.raises((AttributeError, TypeError)):
        keyfn(t, 64, 1, 2.5)  # not an int: the caller falls back to spec_key


def test_the_interpreter_keeps_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    @triton.jit
    def k(p, n, XBLOCK: tl.constexpr):
        pass

    assert Launcher(k, "sha", False, False, False).fast is None
    assert fastlaunch.fast_path_for(object()) is None  # not a JITFunction: plain launches


def test_an_unknown_triton_launches_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    monkeypatch.setattr(triton, "__version__", "9.1.0")
    fastlaunch.reset()
    try:
        assert fastlaunch.abi() is None
    finally:
        fastlaunch.reset()


@pytest.mark.gpu
def test_lean_launches_match_eager_on_a_gpu() -> None:
    """The real path: results right on the first (binder) call and the later (lean) ones."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.runtime.jit import JITFunction

    from stoker_triton import compile_graph

    def f(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.softmax(x * 2 + b, -1), (x + b).sum(0)

    x, b = torch.randn(64, 48, device="cuda"), torch.randn(48, device="cuda")
    fn = compile_graph(make_fx(f, decomposition_table=core_aten_decompositions())(x, b), [x, b])
    runs: list[int] = []
    orig = JITFunction.run
    JITFunction.run = lambda self, *a, **k: runs.append(1) or orig(self, *a, **k)  # type: ignore[method-assign]
    try:
        for _ in range(3):
            x, b = torch.randn_like(x), torch.randn_like(b)
            for got, want in zip(fn(x, b), f(x, b)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    finally:
        JITFunction.run = orig  # type: ignore[method-assign]
    assert len(runs) <= len(fn.report.kernels)  # at most the first call binds


def test_a_launch_reads_torchs_current_device_by_its_c_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton's CUDA driver asks `torch.cuda.current_device` (Python: a lazy-init check,
    then `torch._C._cuda_getDevice`) on every launch; the lean path calls the C function
    itself. Checked with stand-ins for both (this machine may have no CUDA build)."""
    import triton.runtime

    def c_getter() -> int:
        return 0

    monkeypatch.setattr(torch._C, "_cuda_getDevice", c_getter, raising=False)
    fake = type("Driver", (), {})()
    fake.get_current_device = torch.cuda.current_device
    fake.get_current_stream = lambda device: 0
    monkeypatch.setattr(triton.runtime.driver, "_active", fake, raising=False)
    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: fake))
    assert fastlaunch.Abi().device is c_getter
    fake.get_current_device = lambda: 3  # another driver's getter is kept as it is
    assert fastlaunch.Abi().device() == 3

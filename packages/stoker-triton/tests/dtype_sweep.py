"""Machinery of the dtype sweep (test_triton_dtype_sweep.py): every lowering
rule, every dtype it takes, forward and backward, every kernel cross-compiled.

A `Sample` is one call of one aten overload on the sweep's named inputs
(`In("x")`, built per dtype by `make_inputs`); a `Case` is a sample in one
dtype. Cases of one kind run together, all dtypes at once, `CHUNK` to a
graph: one forward FX graph holding every case's call (built node by node,
so the graph holds exactly that overload, not what a decomposition turns it
into) and one backward graph (`make_fx` of `autograd.grad`, one call per
case so each gradient is the case's own). Grouping keeps the number of
compiled kernels, and so the cost of cross-compiling them, small. When a
graph fails as a whole (a kernel Triton refuses), it is bisected to name the
cases that fail.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._decomp import core_aten_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from stoker_triton import compile_graph
from stoker_triton._internal.lowering import LOWERINGS

FLOAT = (torch.float32, torch.float16, torch.bfloat16)
INT = (torch.int64, torch.int32, torch.int8, torch.uint8)
BOOL = (torch.bool,)
ALL = FLOAT + INT + BOOL

# (rtol, atol) against eager. float32: the interpreter's NumPy math against
# torch's (a few ulp). float16/bfloat16: both compute in float32 and round
# once, so a result may differ by one rounding (2**-10 and 2**-7 relative),
# plus the rounding of an input the decomposed graph reads once more.
# Gradients go through decomposed backward formulas whose intermediates
# round differently from eager's fused kernels: four times looser.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
GRAD_SCALE = 4.0

# Cases per graph. Triton's compile time grows faster than linearly with a
# kernel's size (a fused kernel of 500 ops takes a minute, one of 30 ops
# about a second), and every graph has a fixed cost: measured best between.
CHUNK = 32


@dataclasses.dataclass(frozen=True)
class In:
    """One of the sweep's named inputs (see `make_inputs`)."""

    name: str


@dataclasses.dataclass(frozen=True)
class ByDtype:
    """An argument that depends on the sweep's dtype (or device)."""

    fn: Callable[[torch.dtype, torch.device], Any]


D = ByDtype(lambda dt, dev: dt)  # the sweep dtype, e.g. for dtype=...
DEV = ByDtype(lambda dt, dev: dev)  # the sweep device, for device=...


@dataclasses.dataclass(eq=False)
class Sample:
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dtypes: tuple[torch.dtype, ...]
    tag: str = ""  # tells apart two samples of one overload
    values: bool = True  # False: random or uninitialized output, compare sizes and dtypes
    materialize: bool = False  # clone the result (a view of an input needs no kernel)

    @property
    def id(self) -> str:
        return self.op.name() + (f"[{self.tag}]" if self.tag else "")

    @property
    def packet(self) -> str:
        """`namespace::name` of the op, as the coverage check counts rules."""
        return self.op.name().split(".")[0]

    @property
    def kind(self) -> str:
        return LOWERINGS[self.op].kind if self.op in LOWERINGS else "unregistered"


def sample(
    op: torch._ops.OpOverload,
    *args: Any,
    dtypes: Sequence[torch.dtype] = FLOAT,
    tag: str = "",
    values: bool = True,
    materialize: bool = False,
    **kwargs: Any,
) -> Sample:
    return Sample(op, args, kwargs, tuple(dtypes), tag, values, materialize)


def registered_packets() -> set[str]:
    """Every op (`namespace::name`) that has a rule in stoker-triton's lowering table."""
    return {ov.name().split(".")[0] for ov in LOWERINGS}


# --------------------------------------------------------------------------- inputs


def make_inputs(dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The named inputs for `dtype` (tiny: the interpreter runs every kernel)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:  # general values of the sweep dtype
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        lo = 0 if dtype == torch.uint8 else -8
        return torch.randint(lo, 16 + lo, shape, generator=g).to(dtype)

    def positive(*shape: int) -> torch.Tensor:  # domain of log, sqrt, casts to unsigned
        if dtype.is_floating_point:
            return (torch.rand(shape, generator=g) * 4 + 0.25).to(dtype)
        return torch.randint(1, 9, shape, generator=g).to(dtype)

    def nonzero(*shape: int) -> torch.Tensor:  # divisors
        mag = positive(*shape)
        if dtype == torch.uint8 or dtype == torch.bool:
            return mag
        sign = torch.where(torch.rand(shape, generator=g) > 0.5, 1, -1).to(dtype)
        return mag * sign

    def idx(hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, hi, shape, generator=g)

    def unique_rows(n: int, hi: int, cols: int) -> torch.Tensor:  # distinct per column
        return torch.stack([torch.randperm(hi, generator=g)[:n] for _ in range(cols)], 1)

    fl = dtype if dtype.is_floating_point else torch.float32
    out = {
        "x": rnd(4, 8),
        "y": rnd(4, 8),
        "p": positive(4, 8),
        "nz": nonzero(4, 8),
        "row": rnd(8),
        "col": rnd(4, 1),
        "v3": rnd(3, 8),  # index_put values for 3 rows
        "src": rnd(2, 8),  # scatter source
        "sh": torch.randint(0, 4, (4, 8), generator=g).to(dtype),  # shift amounts
        "mask": torch.rand(4, 8, generator=g) > 0.5,
        "prob": torch.rand(4, 8, generator=g).to(fl),
        "f32": torch.randn(4, 8, generator=g),  # promotion partners
        "i64": torch.randint(-4, 4, (4, 8), generator=g),
        "idx": idx(4, 3),  # rows of x, duplicates allowed
        "uidx": torch.randperm(4, generator=g)[:3],  # rows of x, distinct
        "gidx": idx(4, 2, 8),  # gather / accumulate along dim 0
        "sidx": unique_rows(2, 4, 8),  # scatter along dim 0, no two writes to one place
        "m": torch.randn(8, 5, generator=g).to(fl),  # matmul partners
        "bias": torch.randn(5, generator=g).to(fl),
        "b3": torch.randn(2, 4, 8, generator=g).to(fl),
        "b3m": torch.randn(2, 8, 3, generator=g).to(fl),
        "b3a": torch.randn(2, 4, 3, generator=g).to(fl),
        "img": torch.randn(1, 2, 6, 6, generator=g).to(fl),
        "w": torch.randn(3, 2, 3, 3, generator=g).to(fl),
        "cb": torch.randn(3, generator=g).to(fl),
        "go": torch.randn(1, 3, 6, 6, generator=g).to(fl),
    }
    return {k: v.to(device) for k, v in out.items()}


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One sample in one dtype."""

    sample: Sample
    dtype: torch.dtype

    @property
    def id(self) -> str:
        return f"{self.sample.id}/{dtype_name(self.dtype)}"

    def inputs(self) -> list[str]:
        """Names of the inputs it reads (`x/bfloat16`): dtypes share one graph."""
        names: dict[str, None] = {}
        for leaf in pytree.tree_leaves((self.sample.args, self.sample.kwargs)):
            if isinstance(leaf, In):
                names[f"{leaf.name}/{dtype_name(self.dtype)}"] = None
        return list(names)

    def call(self, env: dict[str, Any], device: torch.device) -> list[Any]:
        """Call the op on `env`'s values (tensors, fakes or FX nodes)."""
        args, kwargs = self.resolve(env, device)
        out = self.sample.op(*args, **kwargs)
        outs = list(out) if isinstance(out, tuple | list) else [out]
        if self.sample.materialize:
            outs = [torch.ops.aten.clone.default(o) for o in outs]
        return outs

    def resolve(self, env: dict[str, Any], device: torch.device) -> Any:
        def one(a: Any) -> Any:
            if isinstance(a, In):
                return env[f"{a.name}/{dtype_name(self.dtype)}"]
            if isinstance(a, ByDtype):
                return a.fn(self.dtype, device)
            return a

        return pytree.tree_map(one, (self.sample.args, self.sample.kwargs))


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _inputs_of(cases: Sequence[Case]) -> list[str]:
    return list(dict.fromkeys(n for c in cases for n in c.inputs()))


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class Outcome:
    sample: str
    dtype: torch.dtype
    phase: str  # "forward" | "backward"
    error: str | None  # None: compiled, cross-compiled, ran and matched eager

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.sample, dtype_name(self.dtype), self.phase)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # a cross-compile error ends with the compiler's own message: keep both ends
    if len(lines) > 4:
        lines = [*lines[:2], "...", *lines[-2:]]
    return " | ".join(lines)[:600]


def _compare(got: Sequence[Any], ref: Sequence[Any], scale: tuple[float, float] | None) -> None:
    """Sizes and dtypes; then values (unless `scale` is None) within the
    result dtype's TOLERANCE times `scale`, exactly for integers and bools."""
    if len(got) != len(ref):
        raise AssertionError(f"{len(got)} results, eager has {len(ref)}")
    for i, (g, r) in enumerate(zip(got, ref)):
        if not isinstance(g, torch.Tensor) or g.shape != r.shape or g.dtype != r.dtype:
            what = f"{g.dtype}{list(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise AssertionError(f"result {i}: got {what}, eager has {r.dtype}{list(r.shape)}")
        if scale is None:
            continue
        rtol, atol = (
            (scale[0] * TOLERANCE[r.dtype][0], scale[1] * TOLERANCE[r.dtype][1])
            if r.dtype in TOLERANCE
            else (0.0, 0.0)
        )
        torch.testing.assert_close(
            g.detach(),
            r.detach(),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, i=i: f"result {i}: {m}",
        )


def _declined(fn: Any, cases: Sequence[Case]) -> dict[str, str]:
    """Cases whose op's rule declined (the graph ran it through aten instead
    of a kernel): case id -> why. Raises when a declined op is no case's own
    (a backward formula's op): the group is then split to find whose."""
    out: dict[str, str] = {}
    for op, reason in fn.report.fallback_reasons.items():
        target = _overload(op)
        if target not in LOWERINGS or LOWERINGS[target].kind == "extern":
            continue  # no rule to test, or an extern call by design
        why = f"rule declined, {op} ran through aten: {reason}"
        owners = [c.id for c in cases if c.sample.op == target]
        if not owners:
            raise RuntimeError(why)
        out.update(dict.fromkeys(owners, why))
    return out


def _overload(name: str) -> Any:
    ns, _, rest = name.partition(".")
    packet, _, ov = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), ov or "default")
    except AttributeError:
        return None


# --------------------------------------------------------------------------- forward


def _forward(
    cases: Sequence[Case], env: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.fx.GraphModule, list[Any], list[str], list[int]]:
    """One FX graph calling every case's overload; meta["val"] set node by
    node under a fake mode (so nothing is decomposed or retraced). Returns the
    graph, its fake example inputs, input names and each output's case."""
    names = _inputs_of(cases)
    mode = FakeTensorMode()
    fakes = {n: mode.from_tensor(env[n], static_shapes=True) for n in names}
    g = torch.fx.Graph()
    nodes: dict[str, Any] = {}
    for n in names:
        nodes[n] = g.placeholder(n.replace("/", "_"))
        nodes[n].meta["val"] = fakes[n]
    outs: list[torch.fx.Node] = []
    owner: list[int] = []
    with mode:
        for k, c in enumerate(cases):
            args, kwargs = c.resolve(nodes, device)
            fargs, fkwargs = c.resolve(fakes, device)
            node = g.call_function(c.sample.op, args, kwargs)
            val = c.sample.op(*fargs, **fkwargs)
            node.meta["val"] = val
            results: list[tuple[torch.fx.Node, Any]] = [(node, val)]
            if isinstance(val, tuple | list):
                results = []
                for i, v in enumerate(val):
                    item = g.call_function(operator.getitem, (node, i))
                    item.meta["val"] = v
                    results.append((item, v))
            for r, v in results:
                if c.sample.materialize:
                    r = g.call_function(torch.ops.aten.clone.default, (r,))
                    r.meta["val"] = torch.ops.aten.clone.default(v)
                outs.append(r)
                owner.append(k)
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g), [fakes[n] for n in names], names, owner


def run_forward(
    cases: Sequence[Case], env: dict[str, torch.Tensor], device: torch.device
) -> dict[str, str | None]:
    """Compile the forward graph of `cases`, run it, compare with eager: case
    id -> error (None: passed). Raises when the graph as a whole fails."""
    gm, fakes, names, owner = _forward(cases, env, device)
    fn = compile_graph(gm, fakes)
    declined = _declined(fn, cases)
    real = [env[n] for n in names]
    got = list(fn(*real))
    ref = list(gm(*real))
    errors: dict[str, str | None] = {}
    for k, c in enumerate(cases):
        mine = [i for i, o in enumerate(owner) if o == k]
        try:
            _compare(
                [got[i] for i in mine],
                [ref[i] for i in mine],
                (1.0, 1.0) if c.sample.values else None,
            )
            errors[c.id] = None
        except AssertionError as e:
            errors[c.id] = _short(e)
    return {**errors, **declined}


# --------------------------------------------------------------------------- backward


def _grad_inputs(c: Case, env: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in c.inputs() if env[n].dtype.is_floating_point]


def _with_grad(
    c: Case, env: dict[str, torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(results that require grad, inputs they are differentiated for), eagerly."""
    grad = set(_grad_inputs(c, env))
    leaves = {n: env[n].detach().clone().requires_grad_(n in grad) for n in c.inputs()}
    outs = [o for o in c.call(leaves, device) if o.requires_grad]
    return outs, [leaves[n] for n in c.inputs() if n in grad]


def differentiable(c: Case, env: dict[str, torch.Tensor], device: torch.device) -> bool:
    """Eager gives the case a gradient for at least one floating input."""
    if not c.dtype.is_floating_point or not c.sample.values:
        return False
    with torch.enable_grad():
        outs, wrt = _with_grad(c, env, device)
        if not outs:
            return False
        try:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
        except RuntimeError:  # no derivative formula
            return False
    return True


def run_backward(
    cases: Sequence[Case], env: dict[str, torch.Tensor], device: torch.device, seed: int
) -> dict[str, str | None]:
    """Trace `autograd.grad` of every case (one call each, so each gradient is
    the case's own), compile, run, compare with eager's gradients."""
    names = _inputs_of(cases)
    grad_names = {n for n in names if env[n].dtype.is_floating_point}
    g = torch.Generator().manual_seed(seed + 1)
    cots: list[torch.Tensor] = []  # one per differentiable result, drawn once
    n_cots: list[int] = []
    with torch.enable_grad():
        for c in cases:
            outs, _ = _with_grad(c, env, device)
            n_cots.append(len(outs))
            cots += [torch.randn(o.shape, generator=g).to(o.dtype).to(device) for o in outs]

    def grads(*args: torch.Tensor) -> list[torch.Tensor]:
        ins = dict(zip(names, args[: len(names)]))
        cot = list(args[len(names) :])
        out: list[torch.Tensor] = []
        for c, n in zip(cases, n_cots):
            res = [o for o in c.call(ins, device) if o.requires_grad]
            mine, cot = cot[:n], cot[n:]
            wrt = [ins[x] for x in c.inputs() if x in grad_names]
            out += [
                gr
                for gr in torch.autograd.grad(res, wrt, mine, allow_unused=True)
                if gr is not None
            ]
        return out

    def inputs() -> list[torch.Tensor]:
        return [env[n].detach().clone().requires_grad_(n in grad_names) for n in names] + cots

    with torch.enable_grad():
        gm = make_fx(grads, decomposition_table=core_aten_decompositions())(*inputs())
        fn = compile_graph(gm, inputs())
        declined = _declined(fn, cases)
        got = list(fn(*inputs()))
        ref_in = inputs()
        ins = dict(zip(names, ref_in))
        per_case: list[list[torch.Tensor]] = []
        cot = list(cots)
        for c, n in zip(cases, n_cots):
            res = [o for o in c.call(ins, device) if o.requires_grad]
            mine, cot = cot[:n], cot[n:]
            wrt = [ins[x] for x in c.inputs() if x in grad_names]
            gs = torch.autograd.grad(res, wrt, mine, allow_unused=True)
            per_case.append([gr for gr in gs if gr is not None])
    errors: dict[str, str | None] = {}
    start = 0
    for c, ref in zip(cases, per_case):
        try:
            _compare(got[start : start + len(ref)], ref, (GRAD_SCALE, GRAD_SCALE))
            errors[c.id] = None
        except AssertionError as e:
            errors[c.id] = _short(e)
        start += len(ref)
    return {**errors, **declined}


# --------------------------------------------------------------------------- groups


Runner = Callable[[Sequence[Case]], dict[str, str | None]]


def _run_group(cases: Sequence[Case], runner: Runner) -> dict[str, str | None]:
    """All cases in one graph; when that graph fails as a whole (a kernel
    Triton refuses, a lowering error), bisect to find the cases that fail."""
    if not cases:
        return {}
    try:
        return runner(cases)
    except Exception as e:
        if len(cases) == 1:
            return {cases[0].id: _short(e)}
    half = len(cases) // 2
    return {**_run_group(cases[:half], runner), **_run_group(cases[half:], runner)}


def sweep(
    samples: Sequence[Sample],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    alone: Collection[tuple[str, str, str]] = (),
    seed: int = 0,
    chunk: int = CHUNK,
) -> tuple[list[Outcome], dict[str, str]]:
    """Run every sample in every dtype it takes (of `dtypes`), all dtypes in
    one graph: forward, and backward where eager has a gradient. `alone`:
    (sample id, dtype, phase) that run in a graph of their own (known
    failures, which would fail their group). Returns the outcomes and the
    cases eager itself cannot run on this device (case id -> eager's error)."""
    env: dict[str, torch.Tensor] = {}
    for dt in dtypes:
        env.update({f"{k}/{dtype_name(dt)}": v for k, v in make_inputs(dt, device, seed).items()})
    runnable: list[Case] = []
    eager_lacks: dict[str, str] = {}
    for dt in dtypes:
        for s in samples:
            if dt not in s.dtypes:
                continue
            c = Case(s, dt)
            try:
                c.call(env, device)
            except Exception as e:  # eager has no kernel for this dtype here
                eager_lacks[c.id] = _short(e)
                continue
            runnable.append(c)
    phases: list[tuple[str, list[Case], Runner]] = [
        ("forward", runnable, lambda cs: run_forward(cs, env, device)),
        (
            "backward",
            [c for c in runnable if differentiable(c, env, device)],
            lambda cs: run_backward(cs, env, device, seed),
        ),
    ]
    by_id = {c.id: c for c in runnable}
    outcomes: list[Outcome] = []
    for phase, todo, runner in phases:
        apart = [c for c in todo if (c.sample.id, dtype_name(c.dtype), phase) in alone]
        grouped = [c for c in todo if c not in apart]
        results: dict[str, str | None] = {}
        for i in range(0, len(grouped), chunk):
            results.update(_run_group(grouped[i : i + chunk], runner))
        for c in apart:
            results.update(_run_group([c], runner))
        outcomes += [
            Outcome(by_id[cid].sample.id, by_id[cid].dtype, phase, err)
            for cid, err in results.items()
        ]
    return outcomes, eager_lacks

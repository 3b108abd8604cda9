"""`ShapeContext`: one fake mode and one shape env per compilation.

Every stage of a compilation fakeifies and traces through the same context,
so every guard any stage adds (capture, partitioning, the code generator's
specialisations) lands in one `ShapeEnv`.  Guards are read out only at the end,
with `ShapeContext.produce_guards` (seed 002: the unified cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
)
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

from .dims import Dim, Policy
from .errors import DataDependentError, ShapeInputError, SpecializationError
from .guards import build_guard_set
from .inputs import ConstantInput, ContainerInput, ScalarInput, TensorInput
from .plain import CONSTANT_TYPES
from .provenance import Origin, current_origin, origin_from_traceback
from .source import Source

# A per-dim dynamic spec: a `Dim`, True (anonymous dynamic), or None/False (static).
DimSpec = Dim | bool | None
DynamicSpec = bool | None | Mapping[int, DimSpec] | Sequence[DimSpec]


@dataclass(slots=True)
class _DimDecl:
    dim: Dim | None  # None for an anonymous dynamic dim
    source: Source  # the size source it was declared on
    symbol: sympy.Symbol


class _RecordingList(list[Any]):
    """The shape env's guard list, recording each guard's origin as it is added."""

    def __init__(self, items: list[Any], origins: dict[int, Origin]) -> None:
        super().__init__(items)
        self._origins = origins

    def append(self, item: Any) -> None:
        self._origins[len(self)] = current_origin(skip=2)
        super().append(item)


class _RecordingDict(dict[Any, Any]):
    """A shape env dict (replacements, ranges) recording the origin of new or changed keys."""

    def __init__(
        self, items: dict[Any, Any], origins: dict[Any, Origin], only_updates: bool
    ) -> None:
        super().__init__(items)
        self._origins = origins
        self._only_updates = only_updates

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self:
            if self[key] != value:
                self._origins[key] = current_origin(skip=2)
        elif not self._only_updates:
            self._origins[key] = current_origin(skip=2)
        super().__setitem__(key, value)


class ShapeContext:
    """Owns (or adopts) a `FakeTensorMode` and its `ShapeEnv` for one compilation.

    >>> ctx = ShapeContext(policy="dynamic")
    >>> x = ctx.fakeify(torch.randn(8, 4), Source.arg(0), dynamic={0: Dim("batch")})
    >>> with ctx.fake_mode: y = x.sum(0)
    >>> print(ctx.produce_guards())
    """

    def __init__(
        self,
        *,
        policy: Policy | str = Policy.STATIC,
        fake_mode: FakeTensorMode | None = None,
        auto_dynamic: frozenset[tuple[Source, int]] = frozenset(),
    ) -> None:
        self.policy = Policy(policy)
        self.adopted = fake_mode is not None
        if fake_mode is None:
            shape_env = ShapeEnv(duck_shape=False, allow_scalar_outputs=True)
            fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
        if fake_mode.shape_env is None:
            raise ShapeInputError("the adopted FakeTensorMode has no ShapeEnv; create it with one")
        self.fake_mode: FakeTensorMode = fake_mode
        self.shape_env: ShapeEnv = fake_mode.shape_env
        self.auto_dynamic = auto_dynamic  # (tensor source, dim) pairs seen to change
        self.inputs: list[TensorInput | ScalarInput | ConstantInput | ContainerInput] = []
        self.dims: list[_DimDecl] = []
        self.notes: dict[Any, Origin] = {}  # extra origins, e.g. shared Dims
        self.guard_origins: dict[int, Origin] = {}
        self.replacement_origins: dict[Any, Origin] = {}
        self.range_origins: dict[Any, Origin] = {}
        self._first_guard = len(self.shape_env.guards)
        self._by_dim: dict[Dim, _DimDecl] = {}
        # A contiguous tensor whose dynamic dims all name Dims declared already gets
        # their symbols directly (`_fake_of_shared_dims`), not fresh ones tied by a guard
        self.share_dim_symbols = False
        self._install_recorders()

    @classmethod
    def adopt(cls, fake_mode: FakeTensorMode) -> ShapeContext:
        """Use the frontend's fake mode and shape env (Dynamo installs the guards)."""
        return cls(fake_mode=fake_mode)

    def _install_recorders(self) -> None:
        env = self.shape_env
        if not isinstance(env.guards, _RecordingList):
            env.guards = _RecordingList(env.guards, self.guard_origins)
        else:
            self.guard_origins = env.guards._origins
        if not isinstance(env.replacements, _RecordingDict):
            env.replacements = _RecordingDict(env.replacements, self.replacement_origins, False)
        else:
            self.replacement_origins = env.replacements._origins
        if not isinstance(env.var_to_range, _RecordingDict):
            env.var_to_range = _RecordingDict(env.var_to_range, self.range_origins, True)
        else:
            self.range_origins = env.var_to_range._origins

    # ------------------------------------------------------------------ inputs
    def fakeify(
        self, value: Any, source: Source, dynamic: DynamicSpec = None, *, is_param: bool = False
    ) -> Any:
        """Fake tensors (and SymInts/SymFloats when dynamic) for a pytree of inputs.

        ``dynamic``: None follows the policy; True/False for every dim; or a
        per-dim spec (``{0: Dim("batch")}`` or ``[Dim("batch"), None]``).  For a
        pytree, ``dynamic`` may be a matching pytree of such specs.
        Parameters and buffers (``is_param=True``) are static unless a spec says otherwise.
        """
        if isinstance(value, torch.Tensor):
            return self._fakeify_tensor(value, source, dynamic, is_param)
        if isinstance(value, CONSTANT_TYPES):
            self.inputs.append(ConstantInput(source, value))
            return value
        if isinstance(value, int | float):
            return self._fakeify_scalar(value, source, dynamic)
        if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
            self.inputs.append(ContainerInput(source, type(value), (len(value),)))
            specs = self._child_specs(dynamic, len(value), source)
            out = [
                self.fakeify(v, source.item(i), s, is_param=is_param)
                for i, (v, s) in enumerate(zip(value, specs))
            ]
            return type(value)(out)
        if isinstance(value, dict):
            self.inputs.append(ContainerInput(source, type(value), tuple(value.keys())))
            out_d = {}
            for k, v in value.items():
                spec: Any = dynamic.get(k) if isinstance(dynamic, Mapping) else dynamic
                out_d[k] = self.fakeify(v, source.item(k), spec, is_param=is_param)
            return out_d
        raise ShapeInputError(
            f"{source.name}: inputs of type {type(value).__qualname__} are not supported; "
            "pass tensors, Python numbers, None/bool/str/dtype/device constants, "
            "or lists/tuples/dicts of them"
        )

    @staticmethod
    def _child_specs(dynamic: DynamicSpec, n: int, source: Source) -> list[Any]:
        if isinstance(dynamic, Sequence) and not isinstance(dynamic, str):
            if len(dynamic) != n:
                raise ShapeInputError(
                    f"{source.name}: dynamic spec has {len(dynamic)} entries for {n} values"
                )
            return list(dynamic)
        return [dynamic] * n

    def _dim_specs(
        self, t: torch.Tensor, source: Source, dynamic: DynamicSpec, is_param: bool
    ) -> list[DimSpec]:
        n = t.dim()
        if dynamic is None:
            if is_param or self.policy == Policy.STATIC:
                specs: list[DimSpec] = [None] * n
            elif self.policy == Policy.DYNAMIC:
                # sizes 0 and 1 are always specialized: the policy leaves them static
                specs = [True if t.shape[i] > 1 else None for i in range(n)]
            else:  # AUTO: dynamic only where a previous call saw the dim change
                specs = [
                    True if (source, i) in self.auto_dynamic and t.shape[i] > 1 else None
                    for i in range(n)
                ]
            return specs
        if isinstance(dynamic, bool):  # as with the policies, sizes 0 and 1 stay static
            return [dynamic and t.shape[i] > 1 for i in range(n)]
        if isinstance(dynamic, Mapping):
            bad = [d for d in dynamic if not isinstance(d, int) or not -n <= d < n]
            if bad:
                raise ShapeInputError(
                    f"{source.name}: dynamic spec names dims {bad} but the tensor has rank {n}"
                )
            specs = [None] * n
            for d, s in dynamic.items():
                specs[d % n] = s
            return specs
        if isinstance(dynamic, Sequence):
            if len(dynamic) != n:
                raise ShapeInputError(
                    f"{source.name}: dynamic spec has {len(dynamic)} entries for a rank-{n} tensor"
                )
            return list(dynamic)
        raise ShapeInputError(f"{source.name}: unsupported dynamic spec {dynamic!r}")

    def _fakeify_tensor(
        self, t: torch.Tensor, source: Source, dynamic: DynamicSpec, is_param: bool
    ) -> Any:
        if isinstance(t, FakeTensor):
            if t.fake_mode is not self.fake_mode:
                raise ShapeInputError(f"{source.name}: a fake tensor from another fake mode")
            return t
        if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and not isinstance(
            t, torch.nn.Parameter
        ):
            raise ShapeInputError(
                f"{source.name}: tensor subclass {type(t).__name__} is not supported; "
                "pass a plain torch.Tensor (e.g. t.as_subclass(torch.Tensor))"
            )
        if t.is_sparse or t.layout != torch.strided:
            raise ShapeInputError(
                f"{source.name}: layout {t.layout} is not supported (strided only)"
            )
        specs = self._dim_specs(t, source, dynamic, is_param)
        dyn = [DimDynamic.DYNAMIC if s not in (None, False) else DimDynamic.STATIC for s in specs]
        for i, s in enumerate(specs):
            if (isinstance(s, Dim) and s.max is not None and t.shape[i] > s.max) or (
                isinstance(s, Dim) and t.shape[i] < s.lower
            ):
                raise ShapeInputError(
                    f"{source.size(i).name} = {t.shape[i]} is outside {s!r} "
                    f"(sizes 0 and 1 are always specialized, so the minimum is {s.lower})"
                )
        if self.share_dim_symbols and not self.adopted:
            shared = None if is_param else self._fake_of_shared_dims(t, source, specs)
            if shared is not None:
                return shared
        ctx: Any = StatelessSymbolicContext(dynamic_sizes=dyn)
        torch_source = source.to_torch()
        fake = self.fake_mode.from_tensor(t, source=torch_source, symbolic_context=ctx)
        sizes = tuple(_expr(s) for s in fake.shape)
        for i, s in enumerate(specs):
            if s in (None, False):
                continue
            sym = sizes[i]
            if not isinstance(sym, sympy.Symbol):
                raise ShapeInputError(f"{source.size(i).name}: could not make this dim dynamic")
            self._declare_dim(s if isinstance(s, Dim) else None, source.size(i), sym)
        self._record_tensor(source, t, fake, is_param, sizes)
        return fake

    def _fake_of_shared_dims(self, t: torch.Tensor, source: Source, specs: list[DimSpec]) -> Any:
        """A fake of ``t`` whose dynamic dims are the symbols of their Dims, declared on
        an earlier input: what `_fakeify_tensor` makes, without a fresh symbol per dim
        that `_declare_dim` then ties to the Dim's by an equality (each a few sympy
        solves and range refinements, about 1.5 ms a dim).  The guards read the same:
        the input's size is its Dim's symbol, so `build_guard_set` checks it equal to
        the size that binds the symbol.  Only a plain tensor (no Parameter, no view, no
        storage offset) that is dense: the contiguous strides of its sizes, or of its sizes
        in another order of its dims (attention's heads transposed, `_dense_order`: its
        strides are then those expressions, as the usual way infers them), every dynamic dim a
        Dim already declared whose symbol (a size's, positive) still stands for a size
        of this value, some dim dynamic; else None.  Its storage is its own: it aliases no other input's
        fake (the alias guards then say so; a caller that needs them does not opt in)."""
        if type(t) is not torch.Tensor or t._base is not None or t.storage_offset() != 0:
            return None
        if list(t.stride()) == _contiguous(list(t.shape)):
            order = list(range(t.dim()))
        else:
            dense = _dense_order(list(t.shape), list(t.stride()))
            if dense is None:
                return None
            order = dense
        env = self.shape_env
        sizes: list[Any] = []
        decls: list[tuple[_DimDecl, int]] = []
        for i, s in enumerate(specs):
            n = int(t.shape[i])
            if s in (None, False):
                sizes.append(n)
                continue
            if not isinstance(s, Dim) or s not in self._by_dim:
                return None  # a fresh symbol, or the Dim's first input: the usual way
            first = self._by_dim[s]
            sym = env.replace(first.symbol)
            if not isinstance(sym, sympy.Symbol) or _hint_of(env, sym) != n:
                return None  # specialized, or another value: the usual way raises
            if not sym.is_positive:
                # a scalar's symbol: sympy cannot simplify the kernels' ``Max(1, s)``
                # of it, as it does for a size's (a fresh one, replaced by it later)
                return None
            sizes.append(env.create_symintnode(sym, hint=n))
            decls.append((first, i))
        if not decls:
            return None
        strides: list[Any] = [0] * len(sizes)
        step: Any = 1
        for k in reversed(order):
            strides[k] = step
            step = step * sizes[k]
        with self.fake_mode:
            fake = torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device)
        assert isinstance(fake, FakeTensor)
        if t.requires_grad:
            fake.requires_grad_(True)
        for first, i in decls:
            self.dims.append(_DimDecl(first.dim, source.size(i), first.symbol))
        self._record_tensor(source, t, fake, False, tuple(_expr(s) for s in fake.shape))
        return fake

    def _record_tensor(
        self, source: Source, t: torch.Tensor, fake: Any, is_param: bool, sizes: tuple[Any, ...]
    ) -> None:
        """Note a tensor input, its fake and its sizes (strides and storage as the fake has
        them)."""
        self.inputs.append(
            TensorInput(
                source=source,
                fake=fake,
                dtype=t.dtype,
                device=t.device,
                requires_grad=t.requires_grad,
                sizes=sizes,
                strides=tuple(_expr(s) for s in fake.stride()),
                storage_offset=_expr(fake.storage_offset()),
                is_view=t._base is not None,
                storage_key=fake.untyped_storage()._cdata,  # fake storages alias as the real ones do
                is_param=is_param,
                is_param_type=type(t) is torch.nn.Parameter,
            )
        )

    def _declare_dim(self, dim: Dim | None, size_source: Source, sym: sympy.Symbol) -> None:
        decl = _DimDecl(dim, size_source, sym)
        self.dims.append(decl)
        if dim is None:
            return
        lo, hi = dim.lower, dim.max
        # no max: unbounded (int_oo), as torch's own dynamic dims.  A finite stand-in such
        # as 2**62 broke the shape env's solver: a guard `s1 == 10*s0` divides the bound
        # in floats, and the rounded bound of 10*s0 is then no subset of s1's
        self.shape_env.constrain_symbol_range(
            sym, compiler_min=lo, compiler_max=int_oo if hi is None else hi
        )
        self.range_origins[sym] = Origin(note=f"bound of {dim!r}")
        first = self._by_dim.get(dim)
        if first is None:
            self._by_dim[dim] = decl
            return
        # The same Dim on two inputs: one symbol.  The equality guard this adds is
        # exactly the run-time check we need; its origin says why it is there.  Equal to
        # what the first symbol is now: the shape env solves ``Eq(s9, s5)`` for the higher
        # name, so ``s5`` may be replaced by an earlier input's ``s3`` already, and solving
        # the raw ``Eq(s4, s5)`` would overwrite that replacement (``s5 -> s4``): ``s3 ==
        # s4`` then stays a guard, not a replacement, and the trace never sees them equal.
        note = f"{dim!r} is shared by {first.source.name} and {size_source.name}"
        n_before = len(self.shape_env.guards)
        self.shape_env.evaluate_expr(sympy.Eq(sym, self.shape_env.replace(first.symbol)))
        for i in range(n_before, len(self.shape_env.guards)):
            self.guard_origins[i] = Origin(note=note)
        self.notes[sym] = Origin(note=note)

    def _fakeify_scalar(self, v: int | float, source: Source, dynamic: DynamicSpec) -> Any:
        want = dynamic not in (None, False) or (dynamic is None and self.policy == Policy.DYNAMIC)
        if dynamic is None and self.policy == Policy.AUTO:
            want = (source, -1) in self.auto_dynamic
        if not want:
            self.inputs.append(ScalarInput(source, v, None))
            return v
        env, tsrc = self.shape_env, source.to_torch()
        if self.share_dim_symbols and isinstance(v, int) and isinstance(dynamic, Dim):
            first = self._by_dim.get(dynamic)
            sym = None if first is None else env.replace(first.symbol)
            # the Dim's symbol, a size's: as `_fake_of_shared_dims`.  Tied by a guard,
            # the scalar's own symbol (not positive) may replace the size's, and the
            # kernels' ``Max(1, s)`` of it no longer simplify
            if isinstance(sym, sympy.Symbol) and sym.is_positive and _hint_of(env, sym) == v:
                assert first is not None
                self.dims.append(_DimDecl(first.dim, source, first.symbol))
                self.inputs.append(ScalarInput(source, v, sym))
                return env.create_symintnode(sym, hint=v)
        if self.share_dim_symbols and isinstance(v, int) and isinstance(dynamic, Dim) and v > 0:
            # a size held in an int: a positive symbol, as a tensor's size has.  Tied to
            # a size later by a guard, either may replace the other; sympy simplifies
            # the kernels' ``Max(1, s)`` (contiguous strides) only for a positive ``s``
            sym_p = env.create_symbol(
                v, tsrc, DimDynamic.DYNAMIC, positive=True, do_not_specialize_zero_one=True
            )
            out: Any = env.create_symintnode(sym_p, hint=v, source=tsrc)
        elif isinstance(v, int):
            out = env.create_unspecified_symint_and_symbol(v, tsrc, DimDynamic.DYNAMIC)
        else:
            sym = env.create_unspecified_symbol(v, source=tsrc, dynamic_dim=DimDynamic.DYNAMIC)
            out = env.create_symfloatnode(sym, hint=v, source=tsrc)
        expr = _expr(out)
        if isinstance(expr, sympy.Symbol):
            self._declare_dim(dynamic if isinstance(dynamic, Dim) else None, source, expr)
        self.inputs.append(ScalarInput(source, v, expr if isinstance(expr, sympy.Expr) else None))
        return out

    # ------------------------------------------------------------- tracing aids
    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Enter the fake mode and translate shape errors into user-level ones."""
        with self.translate_errors(), self.fake_mode:
            yield

    @contextlib.contextmanager
    def translate_errors(self) -> Iterator[None]:
        """Turn `GuardOnDataDependentSymNode` into a `DataDependentError` naming the line."""
        try:
            yield
        except GuardOnDataDependentSymNode as e:
            raise data_dependent_error(e) from e

    # ---------------------------------------------------------------- read out
    def symbol_sources(self) -> dict[sympy.Symbol, Source]:
        """Each input symbol and the first source it was created for."""
        out: dict[sympy.Symbol, Source] = {}
        for d in self.dims:
            out.setdefault(d.symbol, d.source)
        return out

    def check_dims(self, *, strict: bool = True) -> None:
        """Raise `SpecializationError` if the traced code specialized a declared `Dim`.

        With ``strict`` (export), a `Dim` whose range was narrowed or that was made
        equal to a different `Dim` is an error too.
        """
        env = self.shape_env
        for d in self.dims:
            if d.dim is None:
                continue
            value = env.replace(d.symbol)
            if value.is_number:
                origin = self.replacement_origins.get(d.symbol) or Origin()
                raise SpecializationError(
                    f"{d.dim!r} on {d.source.name} was specialized to the constant {value}: "
                    f"{origin.describe()}.  Remove the Dim for this input, or change the code "
                    "so it does not assume a fixed size (e.g. use x.size(0) or -1 in view/reshape)."
                )
            if not strict:
                continue
            if isinstance(value, sympy.Symbol) and value != d.symbol:
                other = next((o for o in self.dims if o.symbol == value), None)
                if other is not None and other.dim is not None and other.dim != d.dim:
                    origin = self.replacement_origins.get(d.symbol) or Origin()
                    raise SpecializationError(
                        f"{d.dim!r} on {d.source.name} was found equal to {other.dim!r} on "
                        f"{other.source.name}: {origin.describe()}.  Use the same Dim for both."
                    )
            vr = env.var_to_range.get(d.symbol)
            if vr is not None:
                lo, hi = int(vr.lower), vr.upper
                # int_oo (no max) says is_finite, but has no int value
                top = int(hi) if hi.is_finite and hi != int_oo else None
                want_hi = d.dim.max
                if lo > d.dim.lower or (
                    top is not None and top < (2**62 if want_hi is None else want_hi)
                ):
                    origin = self.range_origins.get(d.symbol) or Origin()
                    raise SpecializationError(
                        f"{d.dim!r} on {d.source.name}: the traced code only supports sizes in "
                        f"[{lo}, {hi}]: {origin.describe()}.  Narrow the Dim's min/max to match, "
                        "or change the code."
                    )

    def produce_guards(self) -> Any:
        """Read every guard out of the shape env (call after the last stage)."""
        return build_guard_set(self)


def _hint_of(env: ShapeEnv, sym: sympy.Symbol) -> int | None:
    """The value a backed symbol was created for (``backed_var_to_val`` from torch 2.13,
    ``var_to_val`` before)."""
    table = getattr(env, "backed_var_to_val", None)
    if not isinstance(table, Mapping):
        table = env.var_to_val
    v = table.get(sym)
    return None if v is None else int(v)


def _dense_order(shape: list[int], stride: list[int]) -> list[int] | None:
    """The dims of a dense tensor that is not contiguous, outermost first: the order in
    which its strides are the contiguous strides of its sizes (heads transposed from
    ``(B, T, H, D)`` to ``(B, H, T, D)``: ``[0, 2, 1, 3]``).  None where there is no such
    order (a slice, a broadcast, overlapping memory) or where a size below 2 leaves it
    ambiguous (a size-1 dim's stride is arbitrary): the usual way decides those."""
    if any(n < 2 for n in shape):
        return None
    order = sorted(range(len(shape)), key=lambda k: stride[k], reverse=True)
    step = 1
    for k in reversed(order):
        if stride[k] != step:
            return None
        step *= shape[k]
    return order


def _contiguous(shape: list[int]) -> list[int]:
    """The contiguous strides of ``shape`` (as torch lays them out)."""
    out: list[int] = []
    step = 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


def _expr(v: Any) -> Any:
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return v.node.expr
    return v


def data_dependent_error(e: BaseException) -> DataDependentError:
    origin = origin_from_traceback(e.__traceback__)
    where = origin.describe() if origin.filename else "in the traced code"
    return DataDependentError(
        f"data-dependent control flow {where}: the branch depends on a tensor's value, which "
        "is unknown while tracing.  Compute the condition outside the compiled function, use "
        "torch.where / torch.cond instead of a Python `if`, or state the fact with "
        f"torch._check(...).  (torch said: {str(e).splitlines()[0]})"
    )


def tree_sources(tree: Any, root: Source) -> list[tuple[Source, Any]]:
    """Pair each leaf of a pytree with its `Source` under ``root``."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    out = []
    for path, leaf in leaves:
        src = root
        for k in path:
            key = getattr(k, "idx", None)
            if key is None:
                key = getattr(k, "key", None)
            if key is None:
                key = getattr(k, "name", None)
            src = src.item(key)  # type: ignore[arg-type]
        out.append((src, leaf))
    return out

"""Stage 2 (export): `aot_stage2_export` packages a captured graph with its guards.

An `ExportedGraph` owns its parameters and buffers, checks its guards on every
call (a violation raises with the guard's explanation), saves to one file
(`save` / `stoker_capture.load`), and can be handed to torch's ecosystem as a
``torch.export.ExportedProgram`` (`to_torch_export`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from stoker_shapes import GuardSet, atomic_write

from ..autocast import autocast_off
from ..errors import ExportFormatError, GuardViolationError, UnsupportedError
from ..graphs.serialize import graph_from_json, graph_to_json
from .capture import CapturedGraph
from .state import AOTState, InputKind, OutputKind, qualname

MAGIC = b"STOKER-EXPORT\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<IQQ")  # version, header length, blob length


@dataclass(slots=True)
class ExportSignature:
    """What the exported graph's inputs and outputs are."""

    inputs: list[tuple[str, str, str]]  # per primal: (placeholder, kind, source)
    mutated_inputs: list[int]  # primals whose new values lead the outputs (in order)
    mutated_buffers: list[str]  # names of the buffers among them (BatchNorm stats)
    user_positions: list[int]  # leaf index in flat (args, kwargs) of each user primal
    num_leaves: int  # leaves of (args, kwargs)
    num_params: int  # parameters and buffers at the front of the primals
    outputs: list[tuple[str, Any]]  # per user output: (kind, constant value or None)
    out_spec: str  # pytree spec of the user outputs (treespec_dumps)
    num_fw_outputs: int  # forward outputs of the graph (mutations, user outputs, bases)
    joint: bool  # the graph also computes gradients (tangent inputs, grad outputs)
    in_spec: str  # pytree spec of (args, kwargs) (treespec_dumps)
    # per (args, kwargs) leaf: ["tensor", size, dtype] for a primal, ["const", value] otherwise
    example_leaves: list[list[Any]] = field(default_factory=list)
    # per positional argument then per keyword: {dim: (Dim name, min, max)} for dynamic dims
    dynamic_dims: list[dict[int, tuple[str, int | None, int | None]] | None] = field(
        default_factory=list
    )

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]

    @staticmethod
    def from_json(d: dict[str, Any]) -> ExportSignature:
        d = dict(d)
        d["inputs"] = [tuple(x) for x in d["inputs"]]
        d["outputs"] = [tuple(x) for x in d["outputs"]]
        d["dynamic_dims"] = [
            None if x is None else {int(k): tuple(v) for k, v in x.items()}
            for x in d["dynamic_dims"]
        ]
        return ExportSignature(**d)

    def as_text(self) -> str:
        lines = ["inputs:"] + [f"  {p}: {k} {s}" for p, k, s in self.inputs]
        if self.mutated_buffers:
            lines.append(f"mutated buffers: {', '.join(self.mutated_buffers)}")
        lines.append(f"outputs: {[k for k, _ in self.outputs]}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_text()


@dataclass(slots=True)
class ExportedGraph:
    """A captured graph with its signature, parameters and guards; call, save or hand over."""

    gm: fx.GraphModule  # the functional core-aten graph
    signature: ExportSignature  # inputs, mutated buffers, output structure
    guards: GuardSet  # what must hold of a call's inputs
    params: dict[str, torch.Tensor]  # parameters and buffers by name (owned by the export)
    state: AOTState | None = None  # the pipeline state (None once loaded from disk)
    captured: CapturedGraph | None = None  # the stage-1 result (resume with aot_stage2_compile)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage (pipeline runs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig = self.signature
        if sig.joint:
            how = (
                "resume it with aot_stage2_compile(exported.state, exported.captured)"
                if self.state is not None
                else "a loaded joint export cannot be resumed (the pipeline state is not saved): "
                "export again with joint=True in this process, or with joint=False to run it"
            )
            raise UnsupportedError(f"this is a joint (forward+backward) export; {how}")
        if not self.guards.check(args, kwargs):
            why = self.guards.explain(args, kwargs) or "guards failed"
            raise GuardViolationError(f"inputs rejected by the exported graph's guards: {why}")
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        primals = [*self.params.values(), *(leaves[p] for p in sig.user_positions)]
        with autocast_off():  # the graph holds the casts it was traced with
            outs = list(self.gm(*primals))
        for k, i in enumerate(sig.mutated_inputs):  # write back (buffers and user inputs)
            with torch.no_grad():
                primals[i].copy_(outs[k])
        user = iter(outs[len(sig.mutated_inputs) :])
        flat = [v if kind == OutputKind.CONSTANT.value else next(user) for kind, v in sig.outputs]
        return pytree.tree_unflatten(flat, pytree.treespec_loads(sig.out_spec))

    def example_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Zero inputs shaped like the ones the graph was exported with."""
        leaves: list[Any] = []
        for leaf in self.signature.example_leaves:
            if leaf[0] == "tensor":
                leaves.append(torch.zeros(leaf[1], dtype=getattr(torch, leaf[2])))
            elif leaf[0] == "int":
                leaves.append(int(leaf[1]))
            else:
                leaves.append(leaf[1])
        args, kwargs = pytree.tree_unflatten(leaves, pytree.treespec_loads(self.signature.in_spec))
        return tuple(args), dict(kwargs)

    def as_text(self) -> str:
        took = ", ".join(f"{k} took {v * 1e3:.0f} ms" for k, v in self.timings.items())
        return "\n".join(
            [
                f"ExportedGraph ({'joint' if self.signature.joint else 'inference'})"
                + (f"  # {took}" if took else ""),
                self.signature.as_text(),
                str(self.guards),
                self.gm.code,
            ]
        )

    def __str__(self) -> str:
        return self.as_text()

    # -------------------------------------------------------------- save / load
    def save(self, path: str | os.PathLike[str]) -> None:
        """One file: magic, version, a JSON header (graph, signature, guards), tensors.

        Written atomically (a temporary file, then a rename)."""
        buf = io.BytesIO()
        torch.save({k: v.detach() for k, v in self.params.items()}, buf)
        blob = buf.getvalue()
        header = json.dumps(
            {
                "graph": graph_to_json(self.gm),
                "signature": self.signature.to_json(),
                "guards": self.guards.to_json(),
                "param_names": list(self.params),
                "sha256": hashlib.sha256(blob).hexdigest(),
            }
        ).encode()
        # atomically: a crash or a full disk leaves the old file (or none), never half of one
        atomic_write(
            path, MAGIC + _HEADER.pack(FORMAT_VERSION, len(header), len(blob)) + header + blob
        )

    def to_torch_export(self) -> torch.export.ExportedProgram:
        """This inference export as a ``torch.export.ExportedProgram`` (dynamic dims kept)."""
        if self.signature.joint:
            raise UnsupportedError("to_torch_export() needs an inference export (joint=False)")
        from .torch_export import to_torch_export

        with autocast_off():  # torch.export traces the graph as it is, adding no casts
            return to_torch_export(self)


def load(path: str | os.PathLike[str]) -> ExportedGraph:
    """Read an `ExportedGraph` written by `ExportedGraph.save`."""
    name = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    n = len(MAGIC) + _HEADER.size
    if len(data) < n or not data.startswith(MAGIC):
        raise ExportFormatError(f"{name}: not a stoker export (bad magic or too short)")
    version, hlen, blen = _HEADER.unpack(data[len(MAGIC) : n])
    if version != FORMAT_VERSION:
        raise ExportFormatError(
            f"{name}: stoker export format version {version}; this stoker-capture reads version "
            f"{FORMAT_VERSION}.  Re-export the model with this version."
        )
    if len(data) != n + hlen + blen:
        raise ExportFormatError(
            f"{name}: truncated or padded ({len(data)} bytes, expected "
            f"{n + hlen + blen}); the file was not written completely"
        )
    try:
        header = json.loads(data[n : n + hlen])
        blob = data[n + hlen :]
        if hashlib.sha256(blob).hexdigest() != header["sha256"]:
            raise ExportFormatError(f"{name}: corrupt (tensor data checksum mismatch)")
        tensors = torch.load(io.BytesIO(blob), weights_only=True)
        gm = graph_from_json(header["graph"])
        sig = ExportSignature.from_json(header["signature"])
        guards = GuardSet.from_json(header["guards"])
        params = {k: tensors[k] for k in header["param_names"]}
    except ExportFormatError:
        raise
    except Exception as e:
        raise ExportFormatError(f"{name}: corrupt stoker export ({type(e).__name__}: {e})") from e
    return ExportedGraph(gm, sig, guards, params)


def aot_stage2_export(state: AOTState, graph: CapturedGraph) -> ExportedGraph:
    """Package ``graph`` with its signature, parameters and guards (read out last)."""
    meta = state.meta
    for i in meta.mutated_inputs:
        if meta.inputs[i].mutates_metadata:
            raise UnsupportedError(
                f"export: {meta.inputs[i].source.name} has its size/stride changed in place "
                "(e.g. t_(), unsqueeze_()); exports support data mutation only"
            )
    for o in meta.outputs:
        if o.kind == OutputKind.CONSTANT and not isinstance(
            o.value, int | float | bool | str | type(None)
        ):
            raise UnsupportedError(f"export: output constant {o.value!r} is not serializable")
    params: dict[str, torch.Tensor] = {}
    if state.module is not None:
        named = [*state.module.named_parameters(), *state.module.named_buffers()]
        params = {
            k: v.detach() if isinstance(v, torch.nn.Parameter) and not graph.joint else v
            for k, v in named
        }
    dims_json: list[dict[int, tuple[str, int | None, int | None]] | None] = [
        None if d is None else {int(k): (v.name, v.min, v.max) for k, v in d.items()}
        for d in state.dynamic_dims
    ]
    sig = ExportSignature(
        inputs=[(inp.name, inp.kind.value, inp.source.name) for inp in meta.inputs],
        mutated_inputs=meta.mutated_inputs,
        mutated_buffers=[
            qualname(inp.source)
            for inp in meta.inputs
            if inp.mutated and inp.kind == InputKind.BUFFER
        ],
        user_positions=list(state.user_positions),
        num_leaves=len(state.leaf_template),
        num_params=state.num_params,
        outputs=[
            (o.kind.value, o.value if o.kind == OutputKind.CONSTANT else None) for o in meta.outputs
        ],
        out_spec=pytree.treespec_dumps(meta.out_spec),
        num_fw_outputs=graph.num_fw_outputs,
        joint=graph.joint,
        in_spec=pytree.treespec_dumps(state.in_spec),
        example_leaves=_example_leaves(state),
        dynamic_dims=dims_json,
    )
    # every stage has run: read the guards out now (seed 002)
    state.ctx.check_dims(strict=True)
    guards = state.ctx.produce_guards()
    return ExportedGraph(graph.gm, sig, guards, params, state, graph)


def _example_leaves(state: AOTState) -> list[list[Any]]:
    out: list[list[Any]] = []
    user = iter(state.fake_primals[state.num_params :])
    primal_pos = set(state.user_positions)
    for pos, leaf in enumerate(state.leaf_template):
        if pos not in primal_pos:
            ok = isinstance(leaf, int | float | bool | str)
            out.append(["const", leaf if ok else None])
            continue
        v = next(user, None)
        if isinstance(v, torch.Tensor):
            size = [_hint(s) for s in v.shape]
            out.append(["tensor", size, str(v.dtype).removeprefix("torch.")])
        else:
            out.append(["int", _hint(v)])
    return out


def _hint(s: Any) -> int:
    if isinstance(s, torch.SymInt):
        return int(s.node.hint) if s.node.hint is not None else 2
    return int(s)

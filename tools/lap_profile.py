"""Per-kernel profile of a training step, for `tools/gpu_lap.py` (and by hand).

`profile_steps(step, backend, device)` runs a few steps under `torch.profiler` and
returns each GPU kernel's time per step, grouped by kernel name and sorted, each
kernel put in a kind (stoker / Inductor Triton kernels, cuBLAS, the optimizer's
foreach kernels, other aten kernels, copies) and, where the compiler says so,
with the aten ops it fused:

- stoker: its kernels are named by their source (`stoker_<kind>_<hash>`) and
  stoker-triton keeps each one's fused aten ops (`report.KERNELS`);
- Inductor: each `triton_*` kernel's "Original ATen" comment in the code it
  generated, and its own estimate of the bytes it moves (`kernel_num_gb`, with
  ``TORCHINDUCTOR_BENCHMARK_KERNEL=1``), read from Inductor's code cache.

`pair_kernels(stoker, inductor)` then puts each stoker kernel beside the Inductor
kernel that fused the most similar set of aten ops (views aside), and
`grad_layout(model)` records what the optimizer receives (each ``.grad``'s layout).
On a CPU (the lap's dry run) there are no device events: the CPU ops stand in.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

KINDS = (
    ("stoker", ("stoker_",)),
    ("inductor", ("triton_",)),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "ampere_")),
    ("optimizer", ("multi_tensor_apply", "foreach", "fused_adam")),
    ("copy", ("Memcpy", "Memset", "memcpy", "memset")),
)

# aten ops that only view or copy: left out when kernels are paired by what they fused
VIEW_OPS = frozenset(
    """view _unsafe_view reshape permute transpose t expand unsqueeze squeeze slice select
    split split_with_sizes clone _to_copy contiguous as_strided alias detach""".split()
)


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "aten"


def profile_steps(
    step: Callable[[], Any], backend: str, device: str, steps: int = 3
) -> dict[str, Any]:
    """Run `steps` steps under the profiler; the kernels by name, per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = [
        (e.name, float(e.time_range.elapsed_us()))
        for e in prof.events()
        if (e.device_type.name == "CUDA") == cuda and (cuda or e.name.startswith("aten::"))
    ]
    out = group_kernels(events, steps)
    out.update({"backend": backend, "device": device, "device_events": cuda})
    out["meta"] = kernel_meta(backend)
    for k in out["kernels"]:
        m = out["meta"].get(k["name"])
        if m:
            k.update(m)
    return out


def group_kernels(events: list[tuple[str, float]], steps: int) -> dict[str, Any]:
    """(name, µs) events of `steps` steps -> kernels by name (ms and calls per step),
    the largest first, and the GPU time per step by kind."""
    by: dict[str, list[float]] = {}
    for name, us in events:
        by.setdefault(name, []).append(us)
    kernels = [
        {
            "name": n,
            "kind": kind_of(n),
            "ms_per_step": sum(v) / steps / 1e3,
            "calls_per_step": len(v) / steps,
        }
        for n, v in by.items()
    ]
    kernels.sort(key=lambda k: -k["ms_per_step"])
    kinds: dict[str, float] = {}
    for k in kernels:
        kinds[k["kind"]] = kinds.get(k["kind"], 0.0) + k["ms_per_step"]
    return {
        "steps": steps,
        "kernels": kernels,
        "gpu_ms_per_step": sum(kinds.values()),
        "gpu_ms_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
    }


def headline(prof: dict[str, Any]) -> dict[str, Any]:
    return {
        "gpu_ms_per_step": round(prof["gpu_ms_per_step"], 4),
        "gpu_ms_by_kind": {k: round(v, 4) for k, v in prof["gpu_ms_by_kind"].items()},
    }


# ----------------------------------------------------------------------------- metadata


def kernel_meta(backend: str) -> dict[str, dict[str, Any]]:
    """Kernel name -> what its compiler knows of it (fused aten ops; Inductor's bytes)."""
    try:
        if backend.startswith("stoker"):
            return stoker_meta()
        if backend.startswith("inductor"):
            return inductor_meta()
    except Exception as e:  # the profile stands without it; say why
        return {"<error>": {"error": f"{type(e).__name__}: {e}"}}
    return {}


def stoker_meta() -> dict[str, dict[str, Any]]:
    from stoker_triton._internal.report import KERNELS

    return {
        name: {
            "origins": list(k.origins),
            "stoker_kind": k.kind,
            "xnumel": k.xnumel,
            "rnumel": k.rnumel,
        }
        for name, k in KERNELS.items()
    }


_ORIGIN = re.compile(r"Original ATen: \[([^\]]*)\]")
_DEF = re.compile(r"^(\w+) = async_compile\.triton\('(\w+)'")


def inductor_meta() -> dict[str, dict[str, Any]]:
    """From Inductor's code cache (tools may import Inductor; packages never do): each
    Triton kernel's fused aten ops (the comment above its definition in the generated
    code) and its estimated bytes."""
    from torch._inductor.codecache import PyCodeCache

    mods = list(getattr(PyCodeCache, "modules", []) or [])
    cache = getattr(PyCodeCache, "cache", None)
    if isinstance(cache, dict):
        mods += list(cache.values())
    out: dict[str, dict[str, Any]] = {}
    for mod in mods:
        path = getattr(mod, "__file__", None)
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    out.update(parse_inductor_source(f.read()))
            except OSError:
                pass
        for v in list(vars(mod).values()):
            meta = getattr(v, "inductor_meta", None)
            fn = getattr(getattr(v, "fn", None), "__name__", None)
            if isinstance(meta, dict) and fn:
                entry = out.setdefault(fn, {})
                if meta.get("kernel_num_gb") is not None:
                    entry["bytes"] = int(float(meta["kernel_num_gb"]) * 1e9)
    return out


def parse_inductor_source(src: str) -> dict[str, dict[str, Any]]:
    """Kernel name -> {"origins": [...]} from an Inductor output module's source."""
    out: dict[str, dict[str, Any]] = {}
    last: list[str] | None = None
    for line in src.splitlines():
        m = _ORIGIN.search(line)
        if m:
            last = [o.strip() for o in m.group(1).split(",") if o.strip()]
            continue
        d = _DEF.match(line)
        if d:
            out[d.group(2)] = {"origins": last or []}
            last = None
    return out


# ----------------------------------------------------------------------------- pairing


def _ops(origins: list[str]) -> frozenset[str]:
    names = {o.split(".")[-1] if o.startswith("aten.") else o for o in origins}
    return frozenset(n for n in names if n not in VIEW_OPS)


def pair_kernels(stoker: dict[str, Any], inductor: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stoker kernel with the Inductor kernel whose fused ops overlap its own most
    (Jaccard of the op sets, views aside; at least one op in common), largest first."""
    ind = [(k, _ops(k.get("origins", []))) for k in inductor.get("kernels", [])]
    ind = [(k, ops) for k, ops in ind if k["kind"] == "inductor" and ops]
    rows = []
    for k in stoker.get("kernels", []):
        if k["kind"] != "stoker":
            continue
        ops = _ops(k.get("origins", []))
        best, score = None, 0.0
        for other, oops in ind:
            s = len(ops & oops) / len(ops | oops) if ops | oops else 0.0
            if s > score:
                best, score = other, s
        rows.append(
            {
                "stoker": k["name"],
                "stoker_ms": k["ms_per_step"],
                "stoker_calls": k["calls_per_step"],
                "origins": sorted(ops),
                "inductor": best["name"] if best else None,
                "inductor_ms": best["ms_per_step"] if best else None,
                "inductor_bytes": best.get("bytes") if best else None,
                "similarity": round(score, 3),
            }
        )
    return rows


def pairs_text(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'stoker kernel':<32} {'ms/step':>8} {'calls':>5}  {'inductor kernel':<48} "
        f"{'ms/step':>8} {'sim':>4}  ops"
    ]
    for r in rows:
        ims = f"{r['inductor_ms']:8.3f}" if r["inductor_ms"] is not None else f"{'—':>8}"
        lines.append(
            f"{r['stoker']:<32} {r['stoker_ms']:8.3f} {r['stoker_calls']:5.0f}  "
            f"{(r['inductor'] or '—')[:48]:<48} {ims} {r['similarity']:4.2f}  "
            f"{','.join(r['origins'])[:90]}"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- gradients


def grad_layout(model: torch.nn.Module) -> dict[str, Any]:
    """What `torch.optim` receives: each parameter's ``.grad`` layout against the
    parameter's (strides, contiguity, a view, its own storage, 16-byte alignment)."""
    rows = []
    storages: dict[int, int] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            rows.append({"name": name, "grad": None})
            continue
        st = g.untyped_storage()
        storages[st.data_ptr()] = storages.get(st.data_ptr(), 0) + 1
        rows.append(
            {
                "name": name,
                "dtype": str(g.dtype),
                "same_strides": g.stride() == p.stride(),
                "contiguous": g.is_contiguous(),
                "view": g._is_view(),
                "offset": g.storage_offset(),
                "storage_extra_bytes": st.nbytes() - g.numel() * g.element_size(),
                "aligned16": g.data_ptr() % 16 == 0,
                "requires_grad": g.requires_grad,
            }
        )
    with_grad = [r for r in rows if r.get("grad", 0) is not None]
    return {
        "params": len(rows),
        "with_grad": len(with_grad),
        "all_like_params": all(
            r["same_strides"] and not r["view"] and r["aligned16"] and not r["requires_grad"]
            for r in with_grad
        ),
        "shared_storages": sum(1 for n in storages.values() if n > 1),
        "rows": rows,
    }

"""Train a tiny zoo model two steps under bf16 autocast, eager and stoker side by side.

Run by test_autocast_training.py in a fresh process (TRITON_INTERPRET must be set
before triton is imported).  Arguments: model name, build/batch overrides (JSON),
device ("cpu" | "cuda"), stoker backend ("interpret" | "triton" | "aten"), and
"fp32-rope" to give HF Llama the rotary embedding of transformers releases before
4.5x: ``inv_freq @ position_ids`` and ``cos``/``sin`` inside
``torch.autocast(enabled=False)`` (what failed on the H100).

Prints one JSON line: the worst error of loss, logits, gradients and parameters,
each relative to the largest magnitude of eager's tensor; the executors; kernels.
"""

import copy
import json
import sys
from typing import Any

import torch

import stoker
import stoker_autograd
from stoker._internal.bench.models import get_model


@torch.no_grad()
def fp32_rope_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
    inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
    pos = position_ids[:, None, :].float()
    with torch.autocast(device_type=x.device.type, enabled=False):  # force float32
        freqs = (inv.float() @ pos.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def main() -> None:
    name, overrides, device, backend = sys.argv[1:5]
    variant = sys.argv[5] if len(sys.argv) > 5 else ""
    b = json.loads(overrides)
    spec = get_model(name)
    eager = spec.build(device=device, seed=0, **b)
    if variant == "fp32-rope":
        rope = eager.model.rotary_emb
        rope.__class__ = type("Fp32Rope", (type(rope),), {"forward": fp32_rope_forward})
    model = copy.deepcopy(eager)
    compiled = stoker.compile(model, backend=backend)
    # SGD: a parameter's error is lr times its gradient's (Adam would amplify the
    # rounding noise of gradients near zero into full-size steps)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        scale = float(want.float().abs().max()) or 1.0
        return float((got.float() - want.float()).abs().max()) / scale

    worst = {"loss": 0.0, "logits": 0.0, "grad": 0.0, "param": 0.0}
    where: dict[str, str] = {}
    for _ in range(2):
        inputs, target = spec.batch(2, gen, device, **b)
        with stoker.autograd_enabled(False):
            with torch.autocast(device, dtype=torch.bfloat16):
                out_e = eager(*inputs)
                loss_e = spec.loss(out_e, target)
            opt_e.zero_grad(set_to_none=True)
            loss_e.backward()
        with torch.autocast(device, dtype=torch.bfloat16):
            out_c = compiled(*inputs)
            loss_c = spec.loss(out_c, target)
        opt_c.zero_grad(set_to_none=True)
        loss_c.backward()
        assert out_c.logits.dtype == out_e.logits.dtype, (out_c.logits.dtype, out_e.logits.dtype)
        worst["loss"] = max(worst["loss"], rel(loss_c, loss_e))
        worst["logits"] = max(worst["logits"], rel(out_c.logits, out_e.logits))
        for (pname, pe), pc in zip(eager.named_parameters(), model.parameters()):
            assert pc.grad is not None and pc.grad.dtype == pe.grad.dtype, pname
            r = rel(pc.grad, pe.grad)
            if r > worst["grad"]:
                worst["grad"], where["grad"] = r, pname
        opt_e.step()
        opt_c.step()
        for (pname, pe), pc in zip(eager.named_parameters(), model.parameters()):
            r = rel(pc, pe)
            if r > worst["param"]:
                worst["param"], where["param"] = r, pname
    rep = compiled.stoker_report
    result = {
        "worst": worst,
        "where": where,
        "executors": sorted({r.executor for r in rep.compiles}),
        "kernels": rep.n_kernels,
        "autograd": stoker_autograd.stats(),
    }
    print(json.dumps(result))


main()

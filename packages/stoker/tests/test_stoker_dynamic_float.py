"""A Python float that changes every call becomes dynamic in Dynamo (automatic
dynamic): the recompiled graphs read it with ``.item()`` of a 0-d input, and the
Triton wrapper must bind that symbol (it once launched ``kernel0(..., zf9)``
with ``zf9`` unbound: a NameError at the call), and compute floats derived from
it (``1.0 / scale``)."""

from __future__ import annotations

import pytest
from interpret_script import run_interpreted

_REPRO = """
import torch, stoker
from torch import nn

class ScaledCube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x**3 * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x**2 * ctx.scale, None

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, scale):
        y = self.lin(x) * scale + x.sum(1, keepdim=True) * (1.0 / scale)
        return ScaledCube.apply(y.tanh(), scale) + scale

torch.manual_seed(0)
model, ref = Model(), Model()
ref.load_state_dict(model.state_dict())
compiled = stoker.compile(model, backend="interpret")
for i in range(3):
    x, scale = torch.randn(2, 4), 0.5 + 0.37 * i
    model.zero_grad(); ref.zero_grad()
    out = compiled(x, scale)
    out.pow(2).sum().backward()
    with stoker.autograd_enabled(False):
        want = ref(x, scale)
        want.pow(2).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_a_float_made_dynamic_runs_through_triton_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted(_REPRO)

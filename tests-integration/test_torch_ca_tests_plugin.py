"""``tools/torch_ca_tests.py``, the pytest plugin that runs PyTorch's compiled-autograd
test file against stoker-autograd (docs/autograd.md, "PyTorch's compiled-autograd
tests"), must not rot: run it on a small file shaped like PyTorch's (the real one is
not in this repository)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPED_LIKE_TORCHS = textwrap.dedent(
    """
    import torch
    from torch._dynamo import compiled_autograd
    from torch._inductor.test_case import TestCase

    import stoker_autograd


    def compiler_fn(gm):
        raise AssertionError("torch's compiler_fn is never called under stoker")


    def reset():
        compiled_autograd.reset()


    class TestCompiledAutograd(TestCase):
        def setUp(self):
            super().setUp()
            reset()

        def tearDown(self):
            super().tearDown()
            reset()

        def check_output_and_recompiles(self, fn, count=1, compiler_fn=compiler_fn, compile_fn=False):
            raise AssertionError("the plugin replaces this")

        def test_basic(self):
            def fn():
                model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
                for b in (2, 3):
                    model(torch.randn(b, 4)).sum().backward()
                    yield model[0].weight.grad.clone()

            self.check_output_and_recompiles(fn, count=99)  # torch's counters: not asserted

        def test_enable_opens_a_stoker_block(self):
            x = torch.randn(3, requires_grad=True)
            with compiled_autograd._enable(compiler_fn):
                assert stoker_autograd.is_enabled()
                x.sin().sum().backward()
            assert not stoker_autograd.is_enabled()
            assert stoker_autograd.stats()["captures"] == 1
            torch.testing.assert_close(x.grad, x.detach().cos())

        def test_left_open(self):
            compiled_autograd._enable(compiler_fn).__enter__()  # reset() closes it

        def test_reset(self):
            raise AssertionError("an excluded test does not run")
    """
)


def test_the_plugin_routes_torchs_enable_to_stoker_and_skips_the_exclusions(tmp_path: Path):
    (tmp_path / "test_compiled_autograd.py").write_text(SHAPED_LIKE_TORCHS)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")) if p
        ),
        "STOKER_CACHE_DIR": str(tmp_path / "cache"),
    }
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "torch_ca_tests", "-p", "no:cacheprovider"),
            *("-q", "-rs", "test_compiled_autograd.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "3 passed, 1 skipped" in out, out[-4000:]
    assert "excluded: asserts torch-internal compiled-autograd state" in out, out[-4000:]
    assert "a test left stoker_autograd enabled" not in out

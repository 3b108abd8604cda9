"""The examples in docs/capture.md run (each python block, in order, in one namespace)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch._dynamo

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "capture.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.skipif(not DOC.exists(), reason="docs/ is not shipped with the package sdist")
def test_doc_examples_run(capsys) -> None:
    torch._dynamo.reset()
    blocks = _blocks()
    assert len(blocks) >= 5
    ns: dict[str, object] = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), ns)
    out = capsys.readouterr().out
    assert "misses" in out and "failed: got 7" in out

"""The first example of docs/autograd.md runs and prints what the page says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "autograd.md"


def test_docs_example_runs_and_prints_the_documented_stats() -> None:
    text = DOC.read_text()
    block = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    expected = re.search(r"^# (\{.*\})$", block, re.M)
    assert expected is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(DOC), "exec"), {})
    assert out.getvalue().strip() == expected.group(1)

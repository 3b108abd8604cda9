"""Which kernels the stoker-triton tests run: native with CUDA, the interpreter
without (or when TRITON_INTERPRET=1 asks). The selection runs in conftest.py
before Triton loads; here it is checked on plain dicts, on any machine."""

import pytest
from triton_mode import select_triton_mode


def test_cuda_machine_runs_native_by_default():
    env: dict[str, str] = {}
    assert select_triton_mode(env, cuda_available=True) == "native"
    assert env["TRITON_INTERPRET"] == "0"
    assert "STOKER_TRITON_CHECK_TARGETS" not in env  # no cross-compiling on a GPU


@pytest.mark.parametrize("unset", [None, "", " "])
def test_cpu_machine_interprets_and_cross_compiles(unset):
    env = {} if unset is None else {"TRITON_INTERPRET": unset}
    assert select_triton_mode(env, cuda_available=False) == "interpret"
    assert env["TRITON_INTERPRET"] == "1"
    assert env["STOKER_TRITON_CHECK_TARGETS"] == "cuda:90"


def test_explicit_choice_wins():
    env = {"TRITON_INTERPRET": "1", "STOKER_TRITON_CHECK_TARGETS": ""}
    assert select_triton_mode(env, cuda_available=True) == "interpret"
    assert env == {"TRITON_INTERPRET": "1", "STOKER_TRITON_CHECK_TARGETS": ""}
    env = {"TRITON_INTERPRET": "0"}
    assert select_triton_mode(env, cuda_available=True) == "native"


def test_unknown_value_is_an_error():
    with pytest.raises(ValueError, match="TRITON_INTERPRET='yes'"):
        select_triton_mode({"TRITON_INTERPRET": "yes"}, cuda_available=True)

"""Run PyTorch's own compiled-autograd tests against stoker-autograd.

PyTorch's ``test/inductor/test_compiled_autograd.py`` (the torch version stoker builds
on) is not part of this repository: copy it anywhere outside it, then load this file
as a pytest plugin::

    cd /path/to/copy
    PYTHONPATH=/path/to/stoker/tools python -m pytest -p torch_ca_tests \\
        test_compiled_autograd.py -p no:cacheprovider

Every ``torch._dynamo.compiled_autograd._enable(compiler_fn)`` (and ``enable``) the
tests open becomes ``stoker_autograd.enable()`` (its default compiler, the aten graph
run as is; torch's ``compiler_fn`` is not called), and ``compiled_autograd.reset()``
(each test's setUp and tearDown) also forgets stoker's captured graphs, closes the
blocks a test left open and gives the next test an empty warm-start cache.  ``check_output_and_recompiles`` keeps its
comparison with eager and drops its two asserts on torch's capture/compile counters.

``STOKER_CA_TESTS=torch`` runs the same selection under torch's own compiled autograd
(with the same relaxed ``check_output_and_recompiles``): the baseline that says which
tests torch itself passes.

``EXCLUDED`` below is the one list of tests not run, each with its reason; they are
reported as skipped with that reason (``STOKER_CA_TESTS_ALL=1`` runs them anyway, to
see what one does).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

# Reasons, one per kind of exclusion.
_COUNTERS = "asserts torch-internal counters (counters['compiled_autograd'|'stats'|'inductor'])"
_LOGS = "asserts torch's compiled-autograd log text (node names, NodeCall numbers, cache-key sizes)"
_GRAPH = "asserts on torch's compiled-autograd FX graph (its text, nodes or placeholders), which stoker never builds"
_TORCH_STATE = (
    "asserts torch-internal compiled-autograd state (module globals, the C++ compiler slot)"
)
_DYNAMO_PATH = (
    "exercises torch.compile's own compiled-autograd switch (torch._dynamo.config.compiled_autograd), "
    "which stoker does not replace; it never opens compiled_autograd._enable"
)
_NO_CA = "does not run compiled autograd at all (Dynamo bytecode / subprocess checks)"
_TORCH_ERROR = (
    "asserts an error that only torch's implementation raises; stoker does what eager does "
    "(by design, docs/autograd.md)"
)
_TORCH_CALLS = (
    "asserts the functions or ops torch's implementation calls under a torch-function or "
    "dispatch mode; stoker shows eager's (by design, docs/autograd.md)"
)

EXCLUDED: dict[str, str] = {
    # -- torch-internal state, counters, logs and graphs
    "test_reset": _TORCH_STATE,
    "test_inputs_aliasing_bytecode_attr_mutations": _TORCH_STATE,
    "test_dynamic_shapes_from_forward": _COUNTERS,
    "test_dynamic_shapes_annotations": _COUNTERS,
    "test_custom_fn_compiled_fw_graph_break": _COUNTERS,
    "test_custom_fn_compiled_fw_bw_graph_break": _COUNTERS,
    "test_autograd_cpp_node_saved_float_is_traceable_False": _COUNTERS,
    "test_autograd_cpp_node_saved_float_is_traceable_True": _COUNTERS,
    "test_cudagraphs_cpu_graph": _COUNTERS,
    "test_higher_order_gradients": _COUNTERS,
    "test_ddp_python_reducer": _COUNTERS,
    "test_logs": _LOGS,
    "test_verbose_logs_graph": _LOGS,
    "test_verbose_logs_aot_id": _LOGS,
    "test_verbose_logs_aot_dispatcher_nodes": _LOGS,
    "test_verbose_logs_aot_dispatcher_nodes_hop": _LOGS,
    "test_verbose_logs_cpp": _LOGS,
    "test_verbose_logs_dynamic_shapes": _LOGS,
    "test_verbose_logs_snapshot": _LOGS,
    "test_tensor_subclass_basic": _GRAPH,
    "test_compiled_autograd_does_not_specialize_on_bw_symints": _GRAPH,
    "test_dont_dce_side_effects": _GRAPH,
    "test_checkpointing_simple_reentrant_False": _GRAPH,
    "test_torch_function_mode": _TORCH_CALLS,
    "test_torch_dispatch_mode": _TORCH_CALLS,
    # -- torch's own errors and limits, where stoker does what eager does (by design;
    #    docs/autograd.md, "PyTorch's compiled-autograd tests")
    "test_nested_context_manager": _TORCH_ERROR,
    "test_callback_graph_break_throws_error": _TORCH_ERROR,
    "test_anomaly_mode_already_nan": _TORCH_ERROR,
    "test_anomaly_mode_backward": _TORCH_ERROR,
    "test_anomaly_mode_grad": _TORCH_ERROR,
    # -- torch.compile's own switch, not compiled_autograd._enable
    "test_compile_api": _DYNAMO_PATH,
    "test_compile_api_disable": _DYNAMO_PATH,
    "test_optimize_assert": _DYNAMO_PATH,
    "test_nested_compile": _DYNAMO_PATH,
    "test_no_nested_compiled_autograd": _DYNAMO_PATH,
    "test_multiple_torch_compile": _DYNAMO_PATH,
    "test_torch_compile_graph_break": _DYNAMO_PATH,
    "test_torch_compile_graph_break2": _DYNAMO_PATH,
    "test_torch_compile_only_backward_call": _DYNAMO_PATH,
    "test_torch_compile_api_dynamic_shapes": _DYNAMO_PATH,
    # -- no compiled autograd in them
    "test_hipify_not_loaded_with_import_torch": _NO_CA,
    "test_hipify_not_loaded_with_import_cpp_extension": _NO_CA,
    "test_dynamo_flaky_segfault": _NO_CA + " (its subprocess runs torch's compiled autograd)",
    "test_inputs_aliasing_bytecode_stack_restore": _NO_CA,
}


def _excluded(name: str) -> str | None:
    """The reason a test (``name`` without its class) is not run, or None.  A
    parametrized test matches its base name too (``test_compile_api_api_compile_...``)."""
    base = re.sub(r"\[.*\]$", "", name)
    if base in EXCLUDED:
        return EXCLUDED[base]
    for key, reason in EXCLUDED.items():
        if base.startswith(key + "_") and key in _PARAMETRIZED:
            return reason
    return None


_PARAMETRIZED = {"test_compile_api", "test_compile_api_disable", "test_optimize_assert"}


def _stoker_mode() -> bool:
    return os.environ.get("STOKER_CA_TESTS", "stoker") != "torch"


def _install() -> None:
    from torch._dynamo import compiled_autograd

    if _stoker_mode():
        import stoker_autograd

        # blocks a test entered by hand and left open (test_nested_context_manager
        # closes the outer one first): reset() closes them, so no later test runs
        # inside them
        open_blocks: list[contextlib.AbstractContextManager[Any]] = []

        @contextlib.contextmanager
        def _enable(compiler_fn: Any = None, *args: Any, **kwargs: Any) -> Iterator[Any]:
            block = stoker_autograd.enable()
            session = block.__enter__()
            open_blocks.append(block)
            try:
                yield session
            finally:
                if block in open_blocks:
                    open_blocks.remove(block)
                    block.__exit__(None, None, None)

        torch_reset = compiled_autograd.reset

        def _reset() -> None:
            torch_reset()
            while open_blocks:
                open_blocks.pop().__exit__(None, None, None)
            stoker_autograd.clear_cache()
            stoker_autograd.reset_stats()
            # an empty disk cache for each test: a warm-start hit on a backward an
            # earlier test stored would skip the retrace this test exercises
            os.environ["STOKER_CACHE_DIR"] = tempfile.mkdtemp(dir=_cache_base())

        compiled_autograd._enable = _enable  # type: ignore[assignment]
        compiled_autograd.enable = _enable  # type: ignore[assignment]
        compiled_autograd.reset = _reset  # type: ignore[assignment]


def _relax_check_output(module: Any) -> None:
    """``check_output_and_recompiles`` without its asserts on torch's counters: the
    outputs of ``fn`` with and without compiled autograd must still be equal."""
    cls = getattr(module, "TestCompiledAutograd", None)
    if cls is None:
        return
    import itertools
    from unittest import mock

    import torch
    from torch._dynamo import compiled_autograd

    default_compiler = module.compiler_fn

    def check_output_and_recompiles(
        self: Any,
        fn: Any,
        count: Any = 1,
        compiler_fn: Any = default_compiler,
        compile_fn: bool = False,
    ) -> None:
        with torch.autograd.set_multithreading_enabled(False):
            torch._dynamo.reset()
            torch._dynamo.utils.counters["compiled_autograd"].clear()
            torch.manual_seed(123)
            expected = list(fn())
            torch.manual_seed(123)
            with (
                compiled_autograd._enable(compiler_fn),
                mock.patch(
                    "torch._functorch.aot_autograd.AOT_COUNTER", new_callable=itertools.count
                ),
            ):
                opt_fn = torch.compile(fn) if compile_fn else fn
                actual = list(opt_fn())
            self.assertEqual(expected, actual)

    cls.check_output_and_recompiles = check_output_and_recompiles


@functools.cache
def _cache_base() -> str:
    return tempfile.mkdtemp(prefix="stoker-ca-tests-")


def pytest_configure(config: pytest.Config) -> None:
    os.environ["STOKER_CACHE_DIR"] = tempfile.mkdtemp(dir=_cache_base())
    _install()


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    seen: set[int] = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and id(module) not in seen:
            seen.add(id(module))
            _relax_check_output(module)
        reason = None if os.environ.get("STOKER_CA_TESTS_ALL") == "1" else _excluded(item.name)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"excluded: {reason}"))

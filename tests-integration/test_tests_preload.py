"""The processes the tests start are forked from servers with torch imported
(tests-support/preload.py): such a process must behave as the interpreter it stands for.
Its command line, directory, environment, streams, descriptors, exit status, signals,
traceback and ending are checked here against what a fresh interpreter does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# the program reports whether it started with torch imported, i.e. was forked
STARTED_FORKED = "import sys; forked = 'torch' in sys.modules\n"


@pytest.fixture(scope="module", autouse=True)
def servers() -> None:
    where = os.environ.get("STOKER_TEST_PRELOAD", "")
    if where in ("", "0"):
        pytest.skip("STOKER_TEST_PRELOAD=0: the tests start their processes for real")
    deadline = time.monotonic() + 120
    while not all(os.path.exists(os.path.join(where, f"{n}.sock")) for n in ("a", "b")):
        assert time.monotonic() < deadline, "the preload servers did not start listening"
        time.sleep(0.1)


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, *args], capture_output=True, text=True, timeout=120, **kwargs
    )


def test_c_code_runs_forked_with_its_argv_directory_environment_and_exit_status(
    tmp_path: Path,
) -> None:
    code = STARTED_FORKED + (
        "import os\n"
        "print(forked, sys.argv, repr(sys.path[0]), os.getcwd(), os.environ['SEEN'])\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    env = {**os.environ, "SEEN": "yes"}
    p = _run(["-W", "ignore", "-c", code, "a b", "3"], cwd=tmp_path, env=env)
    assert p.returncode == 3, p.stderr
    assert p.stdout.split("\n")[0] == f"True ['-c', 'a b', '3'] '' {tmp_path} yes"
    assert p.stderr == "to stderr\n"


def test_a_script_is_main_with_its_folder_on_the_path_and_its_own_traceback(
    tmp_path: Path,
) -> None:
    script = tmp_path / "prog.py"
    script.write_text(
        STARTED_FORKED
        + "class Thing: pass\n"
        + "print(forked, __name__, __file__, sys.path[0], Thing.__module__, sys.argv[1:])\n"
        + "raise ValueError('boom')\n"
    )
    p = _run([str(script), "x"])
    assert p.returncode == 1
    assert p.stdout.split() == ["True", "__main__", str(script), str(tmp_path), "__main__", "['x']"]
    # the traceback starts in the program, as a fresh interpreter's does
    assert p.stderr.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 4, in <module>',
        "    raise ValueError('boom')",
        "ValueError: boom",
    ]


def test_a_module_runs_as_main() -> None:
    p = _run(["-m", "json.tool"], input='{"b": [1]}')
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["{", '"b":', "[", "1", "]", "}"]


@pytest.mark.parametrize(
    "env", [{"STOKER_TEST_FRESH_PROCESS": "1"}, {"PYTHONHASHSEED": "7"}, {"TORCH_LOGS": "+dynamo"}]
)
def test_processes_that_must_be_fresh_interpreters_start_for_real(env: dict[str, str]) -> None:
    p = _run(["-c", STARTED_FORKED + "print(forked)"], env={**os.environ, **env})
    assert p.stdout.strip() == "False", p.stderr


def test_two_processes_in_a_row_hash_strings_differently() -> None:
    """Two consecutive processes (one writes a cache, the next reads it) run on the two
    servers, whose hash seeds differ, as two real processes' would."""
    code = STARTED_FORKED + "print(forked, hash('stoker'))"
    first, second = (_run(["-c", code]).stdout.split() for _ in range(2))
    assert first[0] == second[0] == "True"
    assert first[1] != second[1]


def test_stdin_and_passed_descriptors_are_the_processes_own() -> None:
    r, w = os.pipe()
    try:
        code = STARTED_FORKED + f"import os; os.write({w}, sys.stdin.read().upper().encode())"
        p = _run(["-c", code], input="through stdin", pass_fds=[w])
        assert p.returncode == 0, p.stderr
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"THROUGH STDIN"


def test_exit_handlers_run_and_open_files_are_flushed(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    code = (
        "import atexit, threading, time\n"
        f"f = open({str(out)!r}, 'w')\n"
        "f.write('written, never closed;')\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread joined'))).start()\n"
    )
    p = _run(["-c", code])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["thread joined", "atexit ran"]
    assert out.read_text() == "written, never closed;"


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_process_killed_at_its_timeout_takes_its_program_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], timeout=3)
    pid = int(pid_file.read_text())
    assert _gone(pid), "the program outlived the process the test killed"


def test_signals_reach_the_program() -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('terminated', flush=True), sys.exit(5)))\n"
        "print('ready', flush=True)\n"
        "try:\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(6)\n"
    )
    for sig, said, status in ((signal.SIGTERM, "terminated", 5), (signal.SIGINT, "interrupted", 6)):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        assert p.stdout.readline() == "ready\n"
        time.sleep(0.5)  # out of print(): a signal inside it interrupts the print itself
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
        assert (out.strip(), p.returncode) == (said, status)
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    p.kill()
    assert p.wait(timeout=60) == -signal.SIGKILL


def test_spawned_multiprocessing_children_work(tmp_path: Path) -> None:
    script = tmp_path / "spawner.py"
    script.write_text(
        "import multiprocessing as mp\n"
        "def square(x):\n"
        "    return x * x\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(2) as pool:\n"
        "        print(pool.map(square, range(5)))\n"
    )
    p = _run([str(script)])
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[0, 1, 4, 9, 16]"


def test_a_process_with_other_limits_starts_for_real() -> None:
    """What the process inherits besides its environment (here a lower limit on open
    files, as `prlimit` would set; also its user, capabilities and CPU affinity) is the
    program's to see: the server's would not be."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512) - 1, hard))

    code = (
        STARTED_FORKED
        + "import resource; print(forked, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    p = _run(["-c", code], preexec_fn=lower)
    assert p.stdout.split() == ["False", str(min(soft, 512) - 1)], p.stderr
    p = _run(["-c", code])
    assert p.stdout.split() == ["True", str(soft)], p.stderr


def test_a_forked_process_starts_with_dynamo_imported(tmp_path: Path) -> None:
    """What every compiling process imports (Dynamo, with symbolic shapes and sympy; AOT
    autograd's partitioner, with networkx) is imported once per server, not once per
    process."""
    code = STARTED_FORKED + (
        "import gc, os\n"
        "from torch._dynamo.package import DynamoCache\n"
        "first = ('torch._dynamo', 'torch._functorch.partitioners', 'networkx')\n"
        "print(forked, all(m in sys.modules for m in first), gc.get_freeze_count())\n"
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'], DynamoCache.path_prefix())"
    )
    # nothing frozen, as in a fresh interpreter
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = _run(["-c", code], env=env).stdout.splitlines()
    assert out[0].split() == ["True", "True", "0"]
    default = out[1].split()[0]
    assert out[1].split() == [default, os.path.join(default, "dynamo")]  # as the import sets
    # a cache folder of its own: forked, and Dynamo's store is there
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    out = _run(["-c", code], env=env).stdout.splitlines()
    assert out == ["True True 0", f"{tmp_path} {tmp_path / 'dynamo'}"]


@pytest.mark.parametrize(
    "write",
    [
        'os.environ["TORCH_LOGS"] = "+dynamo"',
        "os.environ.setdefault('TORCHDYNAMO_VERBOSE', '1')",
        'os.putenv("OMP_NUM_THREADS", "1")',
    ],
)
def test_a_program_that_sets_a_variable_read_at_import_starts_for_real(
    tmp_path: Path, write: str
) -> None:
    """A program that sets such a variable itself, before it imports torch (or Triton),
    gets a fresh interpreter that reads it: as a script, as -c code and as a module."""
    body = f"import os\n{write}\n" + STARTED_FORKED + "print(forked)\n"
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_VERBOSE"}
    (tmp_path / "prog.py").write_text(body)
    for args in (["-c", body], [str(tmp_path / "prog.py")], ["-m", "prog"]):
        p = _run(args, cwd=tmp_path, env=env)
        assert p.stdout.strip() == "False", (args, p.stderr)
    # setting a variable to the value it has is no change
    same = "import os\nos.environ['TRITON_INTERPRET'] = " + repr(
        os.environ.get("TRITON_INTERPRET", "")
    )
    p = _run(["-c", same + "\n" + STARTED_FORKED + "print(forked)"], env=env)
    assert p.stdout.strip() == "True", p.stderr


def test_switching_triton_s_mode_from_an_imported_module_fails_saying_why(
    tmp_path: Path,
) -> None:
    """A forked process has Triton imported in the server's mode; a helper module (which
    the server does not read) that switches TRITON_INTERPRET gets an error that says what
    to do, never a Triton of the other mode."""
    pytest.importorskip("triton", reason="Triton decides its mode at import; none here")
    other = "0" if os.environ.get("TRITON_INTERPRET") == "1" else "1"
    (tmp_path / "helper.py").write_text(f"import os\nos.environ['TRITON_INTERPRET'] = '{other}'\n")
    p = _run(["-c", STARTED_FORKED + "print(forked, flush=True)\nimport helper"], cwd=tmp_path)
    assert p.stdout.strip() == "True", p.stderr
    assert p.returncode == 1
    assert "STOKER_TEST_FRESH_PROCESS=1" in p.stderr and "TRITON_INTERPRET" in p.stderr


def test_a_process_started_while_the_servers_import_waits_for_them(tmp_path: Path) -> None:
    """pytest-xdist starts its workers as soon as the session starts, while the servers
    still import: they wait and are forked, rather than import the same beside them."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests-support"))
    try:
        import preload
    finally:
        sys.path.pop(0)
    env = {k: v for k, v in os.environ.items() if k != "STOKER_TEST_PRELOAD"}
    servers = preload.start_servers(str(tmp_path))
    try:
        p = _run(
            ["-c", STARTED_FORKED + "print(forked)"],
            env={**env, "STOKER_TEST_PRELOAD": str(tmp_path)},
        )
        assert p.stdout.strip() == "True", p.stderr
    finally:
        for s in servers:
            s.terminate()
            s.wait()


def test_processes_of_another_environment_get_servers_of_their_own() -> None:
    """Processes whose environment differs in what torch reads at import (the DDP ranks'
    OMP_NUM_THREADS=1): the first starts for real, the second starts a pair of servers
    with that environment and is forked from one, and later ones take turns on both."""
    code = (
        STARTED_FORKED
        + "import os, torch\n"
        + "print(forked, os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), hash('x'))"
    )
    # an environment no other test asks for
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs = [_run(["-c", code], env=env) for _ in range(4)]
    got = [p.stdout.split() for p in runs]
    assert [g[:3] for g in got] == [["False", "1", "1"]] + [["True", "1", "1"]] * 3, [
        p.stderr for p in runs
    ]
    assert got[2][3] != got[3][3], "the variant's two servers have one hash seed"
    # other variables read at import: no servers of their own (each starts for real)
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    code = STARTED_FORKED + "print(forked)"
    assert [_run(["-c", code], env=env).stdout.strip() for _ in range(2)] == ["False"] * 2

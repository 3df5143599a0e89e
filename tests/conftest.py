import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

# The suite's model cache (the dequantized SmolLM2, its CTranslate2 conversion) is its own, under tests/.cache: a
# user's cache cannot break the tests, and the tests never write into it. Set before any w8a8_cpu module reads it;
# child processes (ranks, CLI runs) inherit it.
TEST_CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache")
os.environ["W8A8_CPU_CACHE"] = TEST_CACHE

import w8a8_cpu  # noqa: E402

INFO = w8a8_cpu.info()
COMPILED = INFO["compiled_variants"]
RUNNABLE = set(INFO["runnable_variants"])


def _variant_param(name):
    marks = [] if name in RUNNABLE else [pytest.mark.skip(reason=f"this CPU lacks the features of '{name}'")]
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(params=[_variant_param(v) for v in COMPILED])
def variant(request):
    """Each compiled variant in turn, active for the duration of the test (skipped when the CPU lacks it)."""
    with w8a8_cpu.use_variant(request.param):
        yield request.param


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# Set by ci/emulate-python: the run is under qemu-user, where the exhaustive shape grids take too long.
EMULATED = bool(os.environ.get("W8A8_CPU_TEST_EMULATOR"))


def python_command():
    """argv prefix that starts a child Python like this one. Under ci/emulate-python (qemu-user without
    binfmt_misc) the emulated interpreter cannot exec target binaries itself, so the child is started
    through the emulator named in $W8A8_CPU_TEST_EMULATOR; it inherits QEMU_CPU / QEMU_LD_PREFIX."""
    emulator = os.environ.get("W8A8_CPU_TEST_EMULATOR")
    return [emulator, sys.executable] if emulator else [sys.executable]


def run_python(code: str, *argv: str, timeout: float = 300, **env):
    """Runs `code` in a child Python like this one (python_command) with arguments argv and this environment updated
    by `env` (a None value removes that variable), within `timeout` s. Returns the CompletedProcess (stdout and
    stderr as text)."""
    child_env = {**os.environ, **env}
    return subprocess.run([*python_command(), "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          env={name: value for name, value in child_env.items() if value is not None})


def require_optional(available: bool, hint: str) -> None:
    """Skip a test whose optional component (a model package, an extra) is missing, except under CI=true outside the
    emulated stage, where a missing component fails so that its tests cannot silently stop running."""
    if available:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") and not EMULATED:
        pytest.fail(f"CI must install it: {hint}")
    pytest.skip(f"not installed: {hint}")


def cmake_build(build, *options: str, target: str = "") -> str:
    """Configures this source tree into the folder `build` with `options` (-D..., -G ...) and builds it (only
    `target` when given) on 2 jobs; a failing step fails the test with the end of its output. Returns what the
    configure step printed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configure = subprocess.run(["cmake", "-S", root, "-B", str(build), *options], capture_output=True, text=True,
                               timeout=300)
    assert configure.returncode == 0, configure.stdout[-4000:] + configure.stderr[-4000:]
    built = subprocess.run(["cmake", "--build", str(build), "-j", "2", *(["--target", target] if target else [])],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    return configure.stdout


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op thread count n inside the block, the previous count restored after it (also when the block
    fails, so that one test's count never leaks into the next)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def alarm(seconds: int, what: str):
    """Raises TimeoutError(what) in the main thread after `seconds` (SIGALRM): a regression that blocks (a FIFO opened
    for reading, a lock never released) fails its test instead of hanging the suite."""
    def expired(*_):
        raise TimeoutError(what)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def deadline_fixture(seconds: int, what: str = "blocked"):
    """An autouse fixture that bounds each test of the module that assigns it by alarm(seconds, what):
    `deadline = deadline_fixture(20)`."""
    @pytest.fixture(autouse=True, name="deadline")
    def bounded():
        with alarm(seconds, what):
            yield
    return bounded


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow_under_emulation: heavy or host-compiler-dependent test, deselected by the emulated CI stage "
        "(ci/emulated-python-matrix.sh runs -m 'not slow_under_emulation')",
    )


def communicate_all(procs, timeout_s: float, what: str):
    """communicate() of every process (each started with start_new_session=True), within timeout_s in all. Every
    process group still running afterwards (a timeout, a failing test) is killed and waited for; a timeout fails the
    test naming `what`."""
    deadline = time.monotonic() + timeout_s
    try:
        return [p.communicate(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {timeout_s} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

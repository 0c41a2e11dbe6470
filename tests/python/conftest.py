import getpass
import os
import tempfile

# Inductor's on-disk caches do not key on ATEN_CPU_CAPABILITY, and code cached
# under one capability fails to build under another (.ci/run runs both): one
# cache directory per capability, for this process and the ranks it starts
# (set before anything imports torch: inductor fixes its directory once).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from prefire._torch_range import minor_release  # noqa: E402


def torch_release():
    """(major, minor) of this process's torch: 2.14.1+cu130 -> (2, 14)."""
    return minor_release(torch.__version__)


# Note [Known differences of a torch release]
# Some tests meet a difference of one torch release's own, which no code of
# prefire's can route around: the release fails inside torch where the test
# needs it to work. Per release, the text of that failure and what differs
# (docs/development.md lists them). A test that fails with that text under
# that release is reported as an expected failure naming the difference, in
# the run's counts (xfailed); one that fails otherwise fails. Each
# difference has a test of its own that shows it on every release
# (test_torch_differences.py), so a release that stops differing is seen.
KNOWN_DIFFERENCES = {
    (2, 11): (
        ("Pair is not connected",
         "its V-shaped schedules (ZBV, DualPipeV) greet each neighbouring stage through the process group at the "
         "first step, a stage on the same rank too, which Gloo refuses"),
        ("Attribute '_input_metadata' is invalid",
         "its stage_backward_weight reads _input_metadata of a torch.compile'd function's node"),
    ),
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    text = str(report.longrepr)
    for needle, what in KNOWN_DIFFERENCES.get(torch_release(), ()):
        if needle in text:
            report.outcome = "skipped"
            report.wasxfail = f"a known difference of torch {torch.__version__}: {what}"
            return


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Bit-equality depends on the intra-op thread count (CPU reductions split
    by it): pin it for every test, whatever this machine's default is."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_children_left():
    """A check that this process has no child process left (the pipeline
    tests: no rank outlives its launcher), but multiprocessing's resource
    tracker, which a spawn-started test earlier in the same session leaves
    running by design."""
    def check() -> bool:
        from multiprocessing import resource_tracker

        children = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
        return not children - {resource_tracker._resource_tracker._pid}

    return check


@pytest.fixture(scope="module")
def one_rank():
    """A process group of one rank (Gloo), for schedules whose stages all
    live in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()

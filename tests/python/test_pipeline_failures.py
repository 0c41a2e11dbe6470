"""The pipeline program's launcher when things go wrong: a rank that raises
(in forward, inside a bubble prefire) ends the run with a report that leads
with that rank's exception and traceback; the launcher killed by SIGTERM or
SIGKILL, during start-up or mid-run, leaves no process and no temporary file
10 s later (Note [No process outlives the launcher] in
apps/pipeline_bench/launch.py). Linux, CPU, Gloo over loopback."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from pipeline_bench import run
from pipeline_bench.config import RunConfig
from pipeline_bench.model import ModelConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

TINY = ModelConfig(vocab=64, dim=32, heads=2, blocks=4, seq=16, batch=4, micro_batches=2)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temporary directory of this test's own for the launcher's files."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("where, modes, expected", [
    ("forward:1", ("none",), "injected fault: a forward of stage"),
    ("bubble:*", ("prefire",), "injected fault: a recomputation of block"),
], ids=["forward", "bubble-prefire"])
def test_a_failing_rank_is_reported_with_its_exception_first(where, modes, expected, monkeypatch, private_tmp,
                                                             no_children_left):
    monkeypatch.setenv("PREFIRE_PIPELINE_FAULT", where)
    cfg = RunConfig(model=TINY, schedule="zbv", modes=modes, steps=1, warmup=4, timeout_s=120)
    with pytest.raises(RuntimeError) as raised:
        run(cfg, world=2)
    report = str(raised.value)
    assert report.startswith("pipeline_bench: rank ")
    head = report.split("Its last output lines:")[0]
    assert "Its exception:\nTraceback (most recent call last):" in head
    assert "InjectedFault: " + expected in head, report
    assert no_children_left()
    assert list(private_tmp.iterdir()) == [], "the run left temporary files"


def processes_mentioning(text):
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.parametrize("when", ["start-up", "mid-run"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_launcher_leaves_no_process_and_no_file(sig, when, tmp_path):
    work = tmp_path / "launcher-tmp"
    work.mkdir()
    env = dict(os.environ, TMPDIR=str(work))
    env.pop("PREFIRE_PIPELINE_FAULT", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pipeline_bench", "--modes", "none", "--steps", "100000", "--warmup", "0",
         "--blocks", "4", "--dim", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--batch", "4",
         "--micro-batches", "2", "--timeout", "300"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the ranks exist (their command lines name files in the launcher's directory) ...
        assert wait_for(lambda: len(processes_mentioning(str(work))) >= 2, 120), "the ranks never started"
        if when == "mid-run":  # ... and have joined their process group and run steps
            assert wait_for(lambda: len(list(work.glob("*/*.running"))) == 2, 120), "the ranks never ran"
            time.sleep(1.0)
        launcher.send_signal(sig)
        launcher.wait(timeout=60)
        assert launcher.returncode == -signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM
        assert wait_for(lambda: not processes_mentioning(str(work)), 10), \
            f"processes left 10 s after the launcher died: {processes_mentioning(str(work))}"
        assert wait_for(lambda: not list(work.iterdir()), 10), f"files left: {list(work.iterdir())}"
    finally:
        for pid in processes_mentioning(str(work)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

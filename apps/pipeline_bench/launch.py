"""Starts the ranks of one run of the pipeline program as processes of their
own on this machine (Gloo over loopback, a fresh TCP store on a free port per
run), waits for them under a deadline, and tears every one of them down
whatever happens: a rank that fails or a deadline that passes ends the run
with an error that leads with the failing rank's exception, and no process
or temporary file is left (Note [No process outlives the launcher])."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .config import RunConfig

# Note [No process outlives the launcher]
# The ranks and the temporary directory they write to must go with the
# process that started them, however it ends:
#   * returning or raising (a failed rank, the deadline, Ctrl-C): the
#     `finally` kills every rank's process group and the directory is removed;
#   * SIGTERM or SIGHUP: turned into an exception (Terminated) while the ranks
#     run, so the same `finally` runs, and the launcher exits 128 + signal;
#   * SIGKILL, or anything else that gives it no chance: every rank asked the
#     kernel to SIGKILL it when its parent dies (PR_SET_PDEATHSIG, set by a
#     few lines that run before the rank imports anything, and a check that
#     the parent is still the one that started it, for a death in between);
#     and a janitor process, started with the directory, removes the
#     directory when its pipe from the launcher closes (which the kernel does
#     at the launcher's death) and exits. On a normal end the launcher closes
#     the pipe itself after removing the directory, and the janitor finds
#     nothing to do.
# Linux only (prctl); elsewhere ranks can outlive a launcher killed by SIGKILL.

_RANK = """\
import ctypes, os, runpy, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):  # the launcher died before that
        os._exit(70)
sys.argv = ["pipeline_bench.worker"] + sys.argv[2:]
runpy.run_module("pipeline_bench.worker", run_name="__main__", alter_sys=True)
"""

_JANITOR = """\
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
sys.stdin.buffer.read()  # until the launcher closes the pipe, or dies
for _ in range(10):  # ranks dying with the launcher may still hold files for a moment
    shutil.rmtree(sys.argv[1], ignore_errors=True)
    if not os.path.exists(sys.argv[1]):
        break
    time.sleep(0.2)
"""


_APPS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds this program


class Terminated(SystemExit):
    """The launcher got SIGTERM or SIGHUP while its ranks ran."""


@contextlib.contextmanager
def _signals_raise():
    """While the ranks run, SIGTERM and SIGHUP raise Terminated (so cleanup
    runs) instead of ending the process at once. Main thread only (Python
    handles signals there); elsewhere the rank's death signal still holds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _error(out: str) -> Optional[Dict[str, Any]]:
    """The exception a rank wrote before it died (worker.py), if any."""
    try:
        with open(out + ".error") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _failure_report(procs: List[subprocess.Popen], logs: List[str], outs: List[str]) -> str:
    """The failed rank whose exception came first (others usually fail after
    it, on the broken connection), its traceback first, then its output."""
    deadline = time.monotonic() + 2.0  # let the others finish failing, to find the first one
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    errors = {r: _error(outs[r]) for r in range(len(procs))}
    raised = [r for r, e in errors.items() if e is not None]
    if raised:
        r = min(raised, key=lambda r: errors[r]["time"])
        first = f"{errors[r]['traceback'].rstrip()}\n"
    else:
        r = next(r for r, p in enumerate(procs) if p.poll() not in (None, 0))
        first = "(it wrote no exception: killed, or it died in native code)\n"
    others = ", ".join(f"rank {q}: {'running' if p.poll() is None else p.returncode}"
                       for q, p in enumerate(procs) if q != r)
    return (f"pipeline_bench: rank {r} failed (exit {procs[r].returncode}; {others}). Its exception:\n{first}"
            f"Its last output lines:\n{_tail(logs[r])}")


def _kill(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_ranks(cfg: RunConfig, world: int) -> Tuple[List[Dict[str, Any]], List[Dict[str, Dict[str, torch.Tensor]]]]:
    """Runs ``cfg`` on ``world`` ranks; returns each rank's result and its
    gradients by mode. See Note [No process outlives the launcher]."""
    janitor = None
    try:
        with _signals_raise(), tempfile.TemporaryDirectory(prefix="prefire-pipeline-") as work:
            janitor = subprocess.Popen([sys.executable, "-c", _JANITOR, work], stdin=subprocess.PIPE,
                                       start_new_session=True)
            return _run_ranks_in(work, cfg, world)
    finally:
        if janitor is not None:
            janitor.stdin.close()
            janitor.wait()


def _run_ranks_in(work: str, cfg: RunConfig, world: int):
    """The ranks of one run, writing to `work`; see run_ranks."""
    config_path = os.path.join(work, "config.json")
    with open(config_path, "w") as f:
        f.write(cfg.to_json())
    # The store lives here, so its port is taken before any rank starts.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.timeout_s))
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # the ranks import this program from where it is (apps/), whatever the launcher's sys.path
    env["PYTHONPATH"] = os.pathsep.join([_APPS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    procs: List[subprocess.Popen] = []
    logs = [os.path.join(work, f"rank{r}.log") for r in range(world)]
    outs = [os.path.join(work, f"rank{r}") for r in range(world)]
    try:
        for r in range(world):
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", _RANK, str(os.getpid()), config_path, str(r), str(world),
                     str(store.port), outs[r]],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + cfg.timeout_s
        while True:
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(_failure_report(procs, logs, outs))
            if all(p.poll() == 0 for p in procs):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline_bench: the ranks ran past {cfg.timeout_s:.0f} s; "
                                   f"rank 0's output:\n{_tail(logs[0])}")
            time.sleep(0.05)
    finally:
        _kill(procs)
        del store
    results = []
    grads = []
    for out in outs:
        with open(out + ".json") as f:
            results.append(json.load(f))
        grads.append(torch.load(out + ".grads.pt"))
    return results, grads

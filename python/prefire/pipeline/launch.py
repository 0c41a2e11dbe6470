"""Starts the ranks of one run of the pipeline program as processes of their
own on this machine (Gloo over loopback, a fresh TCP store on a free port per
run), waits for them under a deadline, and tears every one of them down
whatever happens: a rank that fails or a deadline that passes ends the run
with an error that carries the rank's output, and no process is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from .config import RunConfig


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


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
    gradients by mode."""
    with tempfile.TemporaryDirectory(prefix="prefire-pipeline-") as work:
        config_path = os.path.join(work, "config.json")
        with open(config_path, "w") as f:
            f.write(cfg.to_json())
        # The store lives here, so its port is taken before any rank starts.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=cfg.timeout_s))
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs: List[subprocess.Popen] = []
        logs = [os.path.join(work, f"rank{r}.log") for r in range(world)]
        outs = [os.path.join(work, f"rank{r}") for r in range(world)]
        try:
            for r in range(world):
                with open(logs[r], "w") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "prefire.pipeline.worker", config_path, str(r), str(world),
                         str(store.port), outs[r]],
                        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            deadline = time.monotonic() + cfg.timeout_s
            while True:
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    r = failed[0]
                    raise RuntimeError(f"prefire.pipeline: rank {r} exited with "
                                       f"{procs[r].returncode}; its output:\n{_tail(logs[r])}")
                if all(p.poll() == 0 for p in procs):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prefire.pipeline: the ranks ran past {cfg.timeout_s:.0f} s; "
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

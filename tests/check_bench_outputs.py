#!/usr/bin/env python3
"""Runs prefire-bench on a tiny stage and checks what it writes: the JSON
report has every mode with every figure, the trace is valid Chrome trace JSON
with every schedule phase, and the SVG is well-formed SVG with one labelled
point per mode; a second run in the zbh1 order checks its recomputation
counts, a third the memory sweep (every plan within its budget), and a bad
flag gives a usage error. Gradients must match the
unchecked run bit for bit (CPU, one thread: the program exits non-zero
otherwise)."""

import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

MODES = ["none", "torch", "session", "prefire", "budget 25%", "budget 50%"]


def main(bench: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        tiny = [bench, "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--steps", "2",
                "--device", "cpu"]
        cmd = tiny + ["--micro-batches", "2", "--json", str(out / "r.json"), "--plot", str(out / "r.svg"),
                      "--trace", str(out / "t.json")]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print(run.stdout)
        assert run.returncode == 0, f"prefire-bench exited {run.returncode}: {run.stderr}"

        report = json.loads((out / "r.json").read_text())
        assert report["config"]["order"] == "zb", report["config"]
        labels = [m["label"] for m in report["modes"]]
        assert labels == MODES, labels
        for m in report["modes"]:
            for key in ("step_peak_bytes", "peak_held_bytes", "step_ms", "recomputes_per_step", "refused_prefires_per_step",
                        "max_grad_diff", "held_b_to_w_bytes", "held_b_to_w_fraction", "per_micro_batch_ms"):
                assert key in m, (m["label"], key)
            assert m["max_grad_diff"] == 0, (m["label"], m["max_grad_diff"])
            assert len(m["step_ms"]["all"]) == 2
            assert set(m["per_micro_batch_ms"]) == {"forward", "b", "w"}, m["per_micro_batch_ms"]
        by = {m["label"]: m for m in report["modes"]}
        assert by["torch"]["recomputes_per_step"] == 2 * 2 * 2  # micro-batches x layers x passes
        assert by["session"]["recomputes_per_step"] == 2 * 2
        assert by["torch"]["peak_held_bytes"] < by["none"]["peak_held_bytes"]
        # the allocator sees every mode: none holds its activations, checkpointing drops them
        assert all(m["step_peak_bytes"] > 0 for m in report["modes"]), report["modes"]
        assert by["torch"]["step_peak_bytes"] < by["none"]["step_peak_bytes"], (by["torch"], by["none"])
        assert by["none"]["peak_held_bytes"] <= by["none"]["step_peak_bytes"]  # the census is part of what it sees
        assert by["none"]["held_b_to_w_bytes"] is None  # no session: not measured
        for label in (l for l in MODES if l.startswith("budget")):  # a refused checkpoint recomputes in B and W
            m = by[label]
            assert m["recomputes_per_step"] == by["prefire"]["recomputes_per_step"] + m["refused_prefires_per_step"], m
        for label in ("session", "prefire"):  # after B a session keeps only what W unpacks
            assert 0 < by[label]["held_b_to_w_bytes"] < by[label]["peak_session_bytes"], by[label]
            assert 0 < by[label]["held_b_to_w_fraction"] < 1, by[label]

        zbh1 = subprocess.run(tiny + ["--order", "zbh1", "--in-flight", "1", "--micro-batches", "3",
                                          "--modes", "none,torch,prefire", "--json", str(out / "z.json"),
                                          "--trace", str(out / "zt.json")],
                              capture_output=True, text=True, timeout=300)
        assert zbh1.returncode == 0, f"zbh1 run exited {zbh1.returncode}: {zbh1.stderr}"
        z = {m["label"]: m for m in json.loads((out / "z.json").read_text())["modes"]}
        assert z["torch"]["recomputes_per_step"] == 3 * 2 * 2 and z["prefire"]["recomputes_per_step"] == 3 * 2
        assert all(m["max_grad_diff"] == 0 for m in z.values()), z
        # One step of ZB-H1 with one micro-batch in flight: 1F1B, each W after one more B.
        events = [e for e in json.loads((out / "zt.json").read_text())["traceEvents"]
                  if e.get("ph") == "X" and e["pid"] == 0 and e["name"] in ("forward", "B", "W")]
        events.sort(key=lambda e: e["ts"])
        letters = {"forward": "F", "B": "B", "W": "W"}
        step = [letters[e["name"]] + str(e["args"]["micro_batch"]) for e in events][:9]
        assert step == ["F0", "F1", "B0", "F2", "B1", "W0", "B2", "W1", "W2"], step

        # The memory sweep: every plan within its budget (the census), exact gradients, and the configurations
        # a torch user writes recomputing what they checkpoint in B and again in W
        sweep = subprocess.run(tiny[:2] + ["4"] + tiny[3:] + ["--micro-batches", "2", "--memory-sweep",
                                                                "--memory-budgets", "0.1,0.5,1", "--json",
                                                                str(out / "s.json")],
                               capture_output=True, text=True, timeout=300)
        print(sweep.stdout)
        assert sweep.returncode == 0, f"sweep exited {sweep.returncode}: {sweep.stderr}"
        assert "memory sweep" in sweep.stdout and "OVER BUDGET" not in sweep.stdout
        s = {m["label"]: m for m in json.loads((out / "s.json").read_text())["modes"]}
        assert list(s) == ["none", "torch", "torch-every2", "torch-every3", "torch-every4", "plan 10%", "plan 50%", "plan 100%"]
        assert all(m["max_grad_diff"] == 0 for m in s.values()), s
        assert s["torch-every2"]["checkpointed"] == [[True, False, True, False]] * 2  # per micro-batch
        assert s["torch-every2"]["recomputes_per_step"] == 2 * 2 * 2  # micro-batches x checkpointed blocks x passes
        for label in ("plan 10%", "plan 50%", "plan 100%"):
            m = s[label]
            assert m["least_plan_bytes"] <= m["budget_bytes"] and m["plan_bytes"] <= m["budget_bytes"], m
            assert m["peak_held_bytes"] <= m["budget_bytes"], m
            # each checkpointed block of a micro-batch once, again in W where B let go of its recomputation
            assert m["recomputes_per_step"] == sum(sum(per_block) * (1 + released) for per_block, released in
                                                   zip(m["checkpointed"], m["released_per_micro_batch"])), m
        assert s["plan 10%"]["budget_bytes"] == s["plan 10%"]["least_plan_bytes"]  # below the least: the least
        assert all(map(all, s["plan 10%"]["checkpointed"])) and s["plan 10%"]["measuring_held_bytes"] <= s["plan 10%"]["budget_bytes"]
        assert s["plan 100%"]["budget_bytes"] == s["none"]["peak_held_bytes"]

        bad = subprocess.run([bench, "--order", "sideways"], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "--order" in bad.stderr, (bad.returncode, bad.stderr)

        trace = json.loads((out / "t.json").read_text())
        events = trace["traceEvents"]
        names = {e["name"] for e in events}
        for phase in ("forward", "B", "W", "prefire", "clear", "recompute (lazy)", "recompute (prefire)"):
            assert phase in names, phase
        for e in events:
            assert {"name", "ph", "pid", "tid"} <= e.keys(), e
            if e["ph"] == "X":
                assert e["dur"] >= 0 and e["ts"] >= 0, e

        svg = ET.parse(out / "r.svg").getroot()
        assert svg.tag == "{http://www.w3.org/2000/svg}svg", svg.tag
        ns = {"s": "http://www.w3.org/2000/svg"}
        assert len(svg.findall("s:circle", ns)) == len(MODES)
        texts = {t.text for t in svg.findall("s:text", ns)}
        assert set(MODES) <= texts, texts
    print("prefire-bench outputs: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

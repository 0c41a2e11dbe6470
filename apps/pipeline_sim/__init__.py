"""A timeline simulator of pipeline schedules: what the pipeline program
would measure on more ranks than this machine can time.

    python -m pipeline_bench --schedule zbv --modes none,torch,session,prefire --json zbv.json
    python -m pipeline_sim validate zbv.json
    python -m pipeline_sim predict zbv.json --ranks 4,8,16
    python -m pipeline_sim place zbv.json --ranks 2,4,8,16
    python -m pipeline_sim place zbv.json --ranks 8,16 --ratios h200 --plan-sweep sweep.json --json place.json
    python -m pipeline_bench.sweep --json sweep.json
    python -m pipeline_sim search sweep.json
    python -m pipeline_bench.sweep --offload --json sweep.json
    python -m pipeline_sim predict-plans sweep.json --ranks 4,8,16

From the checkout, with the venv's Python and ``PYTHONPATH=build/python:apps``
(or ``scripts/run.sh --simulate COMMAND ...``). The replay: replay.py (Note
[What the simulator replays]); costs from a run and ``validate``:
measured.py; ``predict``: predict.py; ``place``: compare.py, over where
recomputation can run (place.py), the oracle fill and the step's own
recomputation (oracle.py), the joint plan (joint.py) and durations at a GPU's
ratios (ratios.py); ``search``: plan_search.py;
``predict-plans`` (memory plans with and without offloading on more ranks):
plan_predict.py; the command line: cli.py. It uses prefire by public names
only (``prefire``, ``prefire.pipelining``), and the pipeline program's
schedules (``pipeline_bench.config``).
"""

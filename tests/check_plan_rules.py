#!/usr/bin/env python3
"""Plan rules live in src/plan/ (docs/design.md, "The layers"): the Python
package, its programs and prefire-bench ask the C++ planner and never count
a plan themselves. This reads their source for the ways a plan rule was
once written again outside it, and names each:

1. a Choice rebuilt from the plan's flags (``Plan.choices`` and
   ``StagePlan.choices`` say it);
2. a plan's per-item vectors sliced by index into stages or micro-batches
   (``stage_plans`` does that);
3. offloading's costs set by hand (``with_offload``, ``copy_seconds``);
4. a BlockCost's lifetime fields filled in by hand (``rank_blocks``,
   ``rank_items``).

A heuristic over text, as check_layers.py is: a new way to write a rule
again is not caught, but none of these comes back unseen.

Usage: check_plan_rules.py [REPO_ROOT]"""

import pathlib
import re
import sys

from checks import report

RULES = [
    (re.compile(r"\b(OFFLOAD|SELECTIVE|CHECKPOINT|kOffload|kSelective|kCheckpoint)\b[^\n]*\bif\b[^\n]*\belse\b[^\n]*"
                r"\b(SELECTIVE|CHECKPOINT|KEEP|kSelective|kCheckpoint|kKeep)\b|\? *prefire::Choice::"),
     "a Choice rebuilt from flags: read Plan.choices or StagePlan.choices"),
    (re.compile(r"\b(checkpointed|selective|offloaded|pass_bytes|choices)\s*\[\s*[\w +*]*:|"
                r"\.(checkpointed|pass_bytes|choices)\.begin\(\) *\+"),
     "a plan's items sliced by index: ask stage_plans for the plan per stage"),
    (re.compile(r"\boffload_(hidden|bytes)[\"'\]]*\s*=\s*[\d.A-Z]|offload_seconds[\"'\]]*\s*=[^=\n]*/"),
     "offloading's costs set by hand: with_offload and copy_seconds say them"),
    (re.compile(r"\b(alive|done|passes)\s*=\s*(list\()?life\b|\bin_flight\s*=\s*max\("),
     "a block's lifetime filled in by hand: rank_blocks and rank_items give it"),
]


def main() -> int:
    repo = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
    files = sorted(list((repo / "python" / "prefire").rglob("*.py")) + list((repo / "apps").rglob("*.py")) +
                   list((repo / "apps").rglob("*.cpp")))
    errors = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".py" else line.split("//", 1)[0]
            for pattern, what in RULES:
                if pattern.search(code):
                    errors.append(f"{path.relative_to(repo)}:{number}: {what}: {line.strip()}")
    return report("check_plan_rules", errors, f"{len(files)} files, {len(errors)} plan rules outside src/plan/")


if __name__ == "__main__":
    sys.exit(main())

"""How many tests of each Python test file passed, were skipped or failed,
per build (one column per torch release), from the JUnit files ctest's
Python entries write (<build>/pytest/<file>.xml). .ci/run prints it for the
builds of every torch release CI tests, so a file whose tests stopped
running under one torch (skipped whole, not collected) shows:

    python tests/pytest_counts.py build build-torch-2.11.0 build-torch-2.15.0

A cell is passed/skipped/failed (failures and errors), with xfail for the
expected failures where there are any; the last line sums every column.
Exits non-zero where a build has no results or a file has none in a build.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Dict, List


def torch_of(build: str) -> str:
    try:
        with open(os.path.join(build, "python", "prefire", "_build.py")) as f:
            return re.search(r'TORCH_VERSION = "([^"+]+)', f.read()).group(1)
    except (OSError, AttributeError):
        return build


def counts(xml_path: str) -> Counter:
    c: Counter = Counter()
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if "failure" in kinds or "error" in kinds:
            c["failed"] += 1
        elif skipped is not None and skipped.get("type") == "pytest.xfail":
            c["xfail"] += 1
        elif skipped is not None:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    return c


def cell(c: Counter) -> str:
    text = f"{c['passed']}/{c['skipped']}/{c['failed']}"
    return text + (f" +{c['xfail']} xfail" if c["xfail"] else "")


def main(builds: List[str]) -> int:
    table: Dict[str, Dict[str, Counter]] = {}
    missing = []
    for build in builds:
        files = sorted(glob.glob(os.path.join(build, "pytest", "*.xml")))
        if not files:
            missing.append(f"{build}: no results")
        for path in files:
            table.setdefault(os.path.basename(path)[:-4], {})[build] = counts(path)
    names = sorted(table)
    heads = [f"torch {torch_of(b)}" for b in builds]
    width = max([len(n) for n in names] + [10])
    print(f"{'passed/skipped/failed':<{width}}  " + "  ".join(f"{h:<20}" for h in heads))
    totals = {b: Counter() for b in builds}
    for name in names:
        row = []
        for build in builds:
            c = table[name].get(build)
            if c is None:
                missing.append(f"{build}: no results for {name}")
                row.append(f"{'-':<20}")
            else:
                totals[build].update(c)
                row.append(f"{cell(c):<20}")
        print(f"{name:<{width}}  " + "  ".join(row))
    print(f"{'all files':<{width}}  " + "  ".join(f"{cell(totals[b]):<20}" for b in builds))
    for line in missing:
        print("missing: " + line)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

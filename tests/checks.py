"""What the source checks (check_layers.py, check_imports.py,
check_notes.py) share: how they report."""

import sys
from typing import List


def report(name: str, errors: List[str], summary: str) -> int:
    """Prints each error to stderr, then ``name: ok|FAILED (summary)``; the exit status."""
    for e in errors:
        print(e, file=sys.stderr)
    print(f"{name}: {'FAILED' if errors else 'ok'} ({summary})")
    return 1 if errors else 0

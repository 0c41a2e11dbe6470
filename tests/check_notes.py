#!/usr/bin/env python3
"""The `Note [...]` blocks (docs/design.md, "Notes index"): each is written
once, as a line of its own that begins a comment or docstring paragraph
("// Note [Name]", "# Note [Name]", "Note [Name]"); every reference to one,
in the code and the docs, names a Note that exists; a reference that says
where ("Note [Name] in path") names the file that holds it; and the design
doc's index lists every Note once, in the file that holds it. Exits
non-zero naming each mismatch.

Usage: check_notes.py [REPO_ROOT]"""

import pathlib
import re
import sys
from typing import Dict, List

from checks import report

FOLDERS = ("include", "src", "kernels", "profiling", "python", "apps", "tests", "benchmarks", "docs", "scripts",
           "examples")
SUFFIXES = {".h", ".cpp", ".cu", ".c", ".py", ".pyi", ".md", ".sh", ".txt", ".cmake"}
DEFINITION = re.compile(r"^\s*(?://|#)?\s*Note \[([^\]]+)\]\s*$", re.M)
REFERENCE = re.compile(r"Note\s+\[([^\]]+)\](?:\s+in\s+`{0,2}([\w./-]+\.(?:h|cpp|cu|c|py|md))`{0,2})?")
INDEX_ROW = re.compile(r"^\| (.+) \| `([^`]+)` \|$", re.M)


def normal(name: str) -> str:
    """A Note's name as written across lines: comment markers and string joins left out."""
    return " ".join(re.sub(r'///|//|#|"\s*"', " ", name).split())


def sources(root: pathlib.Path) -> List[pathlib.Path]:
    out = []
    for folder in FOLDERS:
        out += [p for p in (root / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()
                and "build" not in p.relative_to(root).parts[:1]]
    return out + [root / "README.md"]


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
    errors = []
    defined: Dict[str, List[pathlib.Path]] = {}
    texts = {p: p.read_text(errors="replace") for p in sources(root)}
    for path, text in texts.items():
        if path.suffix == ".md":
            continue
        for m in DEFINITION.finditer(text):
            defined.setdefault(normal(m.group(1)), []).append(path.relative_to(root))
    for name, paths in sorted(defined.items()):
        if len(paths) > 1:
            errors.append(f"Note [{name}] is written {len(paths)} times: {', '.join(map(str, paths))}")
    for path, text in texts.items():
        for m in REFERENCE.finditer(text):
            name = normal(m.group(1))
            if name in ("...", "Name") or "{" in name:  # how a Note is written, not a Note
                continue
            if name not in defined:
                errors.append(f"{path.relative_to(root)} refers to Note [{name}], which no file writes")
            elif m.group(2) and not any(str(p).endswith(m.group(2)) for p in defined[name]):
                errors.append(f"{path.relative_to(root)} says Note [{name}] is in {m.group(2)}; it is in "
                              f"{defined[name][0]}")
    design = texts[root / "docs" / "design.md"]
    indexed: Dict[str, str] = {}
    for names, where in INDEX_ROW.findall(design[design.index("## Notes index"):]):
        for name in names.split("; "):
            if name in indexed:
                errors.append(f"docs/design.md lists Note [{name}] twice")
            indexed[name] = where
    for name, paths in sorted(defined.items()):
        if name not in indexed:
            errors.append(f"docs/design.md's Notes index misses Note [{name}] ({paths[0]})")
        elif str(paths[0]) != indexed[name]:
            errors.append(f"docs/design.md's Notes index puts Note [{name}] in {indexed[name]}; it is in {paths[0]}")
    for name in sorted(set(indexed) - set(defined)):
        errors.append(f"docs/design.md's Notes index lists Note [{name}], which no file writes")
    return report("check_notes", errors, f"{len(defined)} Notes, {len(errors)} mismatches")


if __name__ == "__main__":
    sys.exit(main())

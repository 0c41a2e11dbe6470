#!/usr/bin/env python3
"""The Python side's imports (docs/design.md, "The layers"), read from the
source without running it:

1. no import circle among the modules of python/prefire, nor among those of
   each program in apps/ (a lower module never imports the one that uses
   it; a narrow interface goes down instead);
2. the programs in apps/ use the library by public names only: no module
   of prefire whose name, or whose package's name, starts with an
   underscore (prefire._C, prefire.pipelining._plan, ...).

Exits non-zero naming each circle and each private import.

Usage: check_imports.py [REPO_ROOT]"""

import ast
import pathlib
import sys
from typing import Dict, List, Set

from checks import report


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: pathlib.Path, path: pathlib.Path) -> List[str]:
    """The absolute names of the modules ``path`` imports (``from x import y``: x.y too, y may be a module)."""
    here = module_name(root, path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append(name)
            out += [f"{name}.{alias.name}" for alias in node.names]
    return out


def graph(root: pathlib.Path, top: str) -> Dict[str, Set[str]]:
    """Module -> the modules of the same top-level package it imports (a package's import of its own
    submodules, which Python runs as part of importing it, left out)."""
    files = {module_name(root, p): p for p in (root / top).rglob("*.py")}
    edges: Dict[str, Set[str]] = {}
    for name, path in files.items():
        edges[name] = {m for m in imports(root, path) if m in files and m != name
                       and not (path.name == "__init__.py" and m.startswith(name + "."))}
    return edges


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Each strongly connected group of more than one module (Tarjan's)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def private(name: str) -> bool:
    return name.startswith("prefire") and any(part.startswith("_") for part in name.split(".")[1:])


def main() -> int:
    repo = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
    errors = []
    roots = [(repo / "python", "prefire")] + [(repo / "apps", p.name) for p in sorted((repo / "apps").iterdir())
                                               if (p / "__init__.py").exists()]
    for root, top in roots:
        for group in circles(graph(root, top)):
            errors.append(f"an import circle in {root.name}/{top}: {' <-> '.join(group)}")
    for root, top in roots[1:]:
        for path in sorted((root / top).rglob("*.py")):
            for name in sorted({m for m in imports(root, path) if private(m)}):
                errors.append(f"{path.relative_to(repo)} imports {name}: the programs use prefire's public names")
    return report("check_imports", errors, f"{len(roots)} packages, {len(errors)} circles or private imports")


if __name__ == "__main__":
    sys.exit(main())

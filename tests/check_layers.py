#!/usr/bin/env python3
"""The layers of src/ (docs/design.md, "The layers"): a file includes its own
layer's headers and those of the layers above it, never below. Exits non-zero
naming each upward include, or a folder of src/ that is in no layer.

Usage: check_layers.py [REPO_ROOT]"""

import pathlib
import re
import sys

from checks import report

# top to bottom; a layer may include the layers before it
LAYERS = ["hooks", "cuda", "memory", "offload", "checkpoint", "session"]
# layers beside the others: they include none of them (plan/ is built without torch besides)
BESIDE = ["split_backward", "plan"]
OUTSIDE = {"kernels", "profiling"}  # device code and the NVTX domain: any layer may use them

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"/]+)/[^"]+"', re.M)


def allowed(layer: str) -> set:
    if layer in BESIDE:
        return {layer} | OUTSIDE
    return set(LAYERS[:LAYERS.index(layer) + 1]) | OUTSIDE


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
    errors = []
    for folder in sorted(p for p in (root / "src").iterdir() if p.is_dir()):
        layer = folder.name
        if layer not in LAYERS and layer not in BESIDE:
            errors.append(f"src/{layer}/ is in no layer: add it to tests/check_layers.py and docs/design.md")
            continue
        ok = allowed(layer)
        for path in sorted(folder.rglob("*")):
            if path.suffix not in (".h", ".cpp", ".cu"):
                continue
            for m in INCLUDE.finditer(path.read_text()):
                if m.group(1) not in ok:
                    errors.append(f"{path.relative_to(root)} includes \"{m.group(1)}/...\": layer {layer} may "
                                  f"include only {sorted(ok)}")
    return report("check_layers", errors, f"{len(errors)} upward includes or unplaced folders")


if __name__ == "__main__":
    sys.exit(main())

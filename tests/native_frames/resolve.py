"""Functions and source lines for the native frames that native_frames.c
wrote into a log (or several): each frame's object and offset through
addr2line (one call per object), the dynamic symbol where the object has no
debug information (torch's libraries), demangled. Prints one block per
crash, innermost frame first:

    python tests/native_frames/resolve.py LOG [LOG...]
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

FRAME = re.compile(r"^#(\d+)\s+(0x[0-9a-f]+|\(nil\))\s+(.+?)\s+\+(0x[0-9a-f]+|0)\s+(\S+)$")


def crashes(text: str) -> List[Tuple[str, List[Tuple[int, int, str, int, str]]]]:
    """Each report: its heading and its frames (index, address, object, offset, symbol)."""
    found, current = [], None
    for line in text.splitlines():
        if line.startswith("== native frames"):
            current = (line.strip("= "), [])
            found.append(current)
        elif line.startswith("== end of native frames"):
            current = None
        elif current is not None:
            match = FRAME.match(line.strip())
            if match:
                index, address, obj, offset, symbol = match.groups()
                address = 0 if address == "(nil)" else int(address, 16)
                current[1].append((int(index), address, obj, int(offset, 16), symbol))
    return found


def is_executable(path: str) -> bool:
    """An ELF executable that is not position-independent: addresses are absolute there."""
    try:
        with open(path, "rb") as f:
            header = f.read(18)
    except OSError:
        return False
    return header[:4] == b"\x7fELF" and int.from_bytes(header[16:18], "little") == 2  # ET_EXEC


def addr2line(obj: str, pcs: List[int]) -> Dict[int, List[Tuple[str, str]]]:
    """(function, file:line) for each pc, the inlined ones first."""
    try:
        out = subprocess.run(["addr2line", "-a", "-C", "-f", "-i", "-e", obj] + [hex(pc) for pc in pcs],
                             capture_output=True, text=True, timeout=120).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    result, pc, i = defaultdict(list), None, 0
    while i < len(out):
        if re.fullmatch(r"0x[0-9a-f]+", out[i]):
            pc, i = int(out[i], 16), i + 1
        elif pc is not None and i + 1 < len(out):
            result[pc].append((out[i], out[i + 1]))
            i += 2
        else:
            i += 1
    return result


def demangle(symbols: List[str]) -> Dict[str, str]:
    names = sorted({s for s in symbols if s != "?"})
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=60).stdout
        return dict(zip(names, out.splitlines()))
    except (OSError, subprocess.SubprocessError):
        return {n: n for n in names}


def resolve(frames: List[Tuple[int, int, str, int, str]]) -> List[str]:
    # A return address is one past its call: look up the byte before it. Not for the handler's own frame (#0),
    # the signal trampoline it returns to (#1, the same address each time a signal was delivered) nor the
    # frame a signal interrupted (after a trampoline): their addresses are the instructions themselves.
    trampoline = frames[1][1] if len(frames) > 1 else None

    def exact(i: int) -> bool:
        return i == 0 or frames[i][1] == trampoline or frames[i - 1][1] == trampoline

    pcs = [((address if is_executable(obj) else offset) - (0 if exact(i) else 1), obj)
           for i, (_, address, obj, offset, _) in enumerate(frames)]
    by_object = defaultdict(list)
    for pc, obj in pcs:
        if obj != "?":
            by_object[obj].append(pc)
    lines_of = {obj: addr2line(obj, sorted(set(p))) for obj, p in by_object.items()}
    names = demangle([f[4] for f in frames])
    out = []
    for (index, _, obj, _, symbol), (pc, _) in zip(frames, pcs):
        where = obj.rsplit("/", 1)[-1]
        found = [(fn, loc) for fn, loc in lines_of.get(obj, {}).get(pc, []) if fn != "??" or not loc.startswith("??")]
        if found and found[0][0] != "??":
            for depth, (function, location) in enumerate(found):
                inlined = "  (inlined)" if depth < len(found) - 1 else ""
                out.append(f"#{index:<3} {function[:160]}  {location}{inlined}  [{where}+{pc:#x}]")
        else:
            out.append(f"#{index:<3} {names.get(symbol, symbol)[:160]}  [{where}+{pc:#x}]")
    return out


def main(paths: List[str]) -> int:
    total = 0
    for path in paths:
        with open(path, errors="replace") as f:
            reports = crashes(f.read())
        for heading, frames in reports:
            total += 1
            print(f"-- {path}: {heading}")
            print("\n".join(resolve(frames)))
    if total == 0:
        print("no native frames in " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The crash capture that scripts/gpu-check.sh runs its Python stages under:
a pytest run with native_frames preloaded (pytest redirects descriptor 2
into a file of its own) faults in a thread of a throwaway test (a function of
the library with debug information, called through ctypes), and dies of
SIGSEGV with faulthandler's Python frames and the native frames in its
stderr; resolve.py names the faulting function and its source file.

    python check_native_frames.py LIBRARY
"""

import os
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main(library: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        test = os.path.join(tmp, "test_deliberate_fault.py")
        with open(test, "w") as f:
            f.write("import ctypes, threading\n\n"
                    "def test_a_thread_faults():\n"
                    f"    lib = ctypes.CDLL({library!r})\n"
                    "    t = threading.Thread(target=lib.prefire_native_frames_deliberate_fault)\n"
                    "    t.start(); t.join()\n")
        child = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                test], capture_output=True, text=True, cwd=tmp,
                               env=dict(os.environ, LD_PRELOAD=library), timeout=120)
    problems = []
    if child.returncode != -signal.SIGSEGV:
        problems.append(f"exit {child.returncode}, not the signal SIGSEGV")
    for expected in ("Fatal Python error: Segmentation fault", "in test_a_thread_faults", "== native frames: signal 11",
                     "== end of native frames =="):
        if expected not in child.stderr:
            problems.append(f"stderr lacks {expected!r}")
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        log.write(child.stderr)
    try:
        resolved = subprocess.run([sys.executable, os.path.join(HERE, "resolve.py"), log.name], capture_output=True,
                                  text=True, timeout=300).stdout
    finally:
        os.unlink(log.name)
    faulting = [line for line in resolved.splitlines() if "prefire_native_frames_deliberate_fault" in line]
    if not faulting or "native_frames.c:" not in faulting[0]:
        problems.append("resolve.py did not name the faulting function and its source file")
    print(resolved)
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems) + "\n--- the child's stderr:\n" + child.stderr)
        return 1
    print("the fault's native frames came out, resolved")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

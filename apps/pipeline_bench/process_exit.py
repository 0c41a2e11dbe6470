"""Ending a process that ran Gloo collectives without finalizing the interpreter.

Note [Leaving a process that ran Gloo collectives]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A Gloo collective runs on one of ProcessGroupGloo's worker threads. The thread
marks the work complete (the caller's ``wait`` returns) and only afterwards
drops its own reference to the work object. When that is the last reference,
the work's tensors are freed on the worker thread, and a tensor that has a
Python object takes the GIL to release it. If the main thread has meanwhile
reached interpreter finalization, taking the GIL ends the worker thread
(CPython's ``pthread_exit``); the forced unwind crosses the work's noexcept
destructor and the process aborts ("terminate called without an active
exception", SIGABRT), after its work was done and its results written.
``dist.destroy_process_group()`` does not prevent it: it drops the group from
``_world``, but FSDP2's and DTensor's device meshes keep the C++ backend, and
its threads, alive until exit. Seen with an FSDP2 test whose last collective,
``DTensor.full_tensor()``, comes just before the worker returns: from one run
in three to one in thirty on two cores, by load.

A process that has finished its work and torn down its process group therefore
leaves with ``os._exit`` after flushing its streams: nothing of the
interpreter is finalized while a Gloo thread may still hold work. Only the
success path does this; a failure still raises and finalizes as usual.
"""

import os
import sys


def exit_process(code: int = 0) -> None:
    """Flushes stdout and stderr and ends the process with ``code`` without
    finalizing the interpreter (Note [Leaving a process that ran Gloo
    collectives]). Call it after ``dist.destroy_process_group()``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

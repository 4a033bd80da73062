"""`python -m runtime.die_with_parent PARENT_PID -- PROGRAM ARGS...`: exec PROGRAM so that the kernel
SIGKILLs it when its parent exits, even if the parent is SIGKILLed.

The launcher starts its children through this instead of a preexec_fn: a preexec_fn forces a plain fork() of a
process whose gRPC threads are running, which can leave the child with broken gRPC state; this way the launcher
spawns cleanly and the death signal is set in the fresh process, then survives the exec.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent, sep, program = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if sep != "--" or not program:
        raise SystemExit("usage: python -m runtime.die_with_parent PARENT_PID -- PROGRAM [ARGS...]")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        raise SystemExit(1)
    os.execv(program[0], program)


if __name__ == "__main__":
    main()

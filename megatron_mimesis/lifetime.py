"""Helper processes end with the process that started them, however it ends.

A parent's cleanup code (``atexit``, ``finally``, DataLoader's ``__del__``) does not run when it is killed with
SIGKILL (the OOM killer, a scheduler's hard kill, a container stop timeout), and its children are re-parented to
init and run on: a DataLoader worker notices after its 5 s status poll at best, a spawned gloo rank waits in a
collective forever. Linux can tie the child to the parent instead: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes
the kernel kill the child the moment the thread that started it exits, whatever the cause. The child asks for
it first thing, then checks that its parent is still the one that started it (it may have died before the
request). Elsewhere than Linux this is a no-op and the libraries' own parent checks remain.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when ``parent_pid`` (its parent) exits; exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def tie_rank_to_launcher() -> None:
    """Under torchrun, end this rank with torchrun: each rank runs in a session of its own, so a SIGKILL of
    torchrun (or of whatever started it) would otherwise leave the ranks holding their memory under init.
    Outside torchrun the parent is a shell or a scheduler step, which a training run must be able to outlive."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(os.getppid())

"""The one process between the pipeline and a stage's command, so that no process of a stage outlives the pipeline.

A stage is a tree of processes the pipeline did not write: a launcher's bash, torchrun and its ranks (each in a
session of its own, tied to torchrun by ``lifetime.tie_rank_to_launcher``), a vLLM server and its engine processes.
When the pipeline is killed with SIGKILL nothing of its own code runs, so the keeper asks the kernel for a SIGTERM
at that moment (``PR_SET_PDEATHSIG``) and stops the stage as a terminal's Ctrl-C would: the signal goes to the
command's whole process group (torchrun forwards it to the ranks, which save), and whatever is left after the grace
period is killed. A signal from the pipeline itself takes the same path; SIGUSR1, SLURM's pre-timeout warning, goes
to the command alone (the launcher traps it, forwards it to srun and requeues the job).

    python -m megatron_mimesis.pipeline.keeper GRACE_S -- COMMAND [ARG ...]
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_group(pgid: int, grace_s: float) -> None:
    """Wait up to ``grace_s`` for the process group to empty, then SIGKILL what is left of it."""
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    grace_s, separator, *command = argv
    if separator != "--" or not command:
        print("usage: python -m megatron_mimesis.pipeline.keeper GRACE_S -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the pipeline died before the request
        return 1
    child = subprocess.Popen(command, process_group=0)
    stopping = []

    def forward(signum, _frame):
        if signum == signal.SIGUSR1:
            os.kill(child.pid, signum)
            return
        stopping.append(signum)
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for signum in (*STOP_SIGNALS, signal.SIGUSR1):
        signal.signal(signum, forward)
    status = child.wait()  # the handlers run in between; the wait resumes after each (PEP 475)
    # the command is done; its group may still hold processes it left (a server's engine, a rank's helper)
    reap_group(child.pid, float(grace_s) if stopping else 5.0)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The one process between the pipeline and a stage's command, so that no process of a stage outlives the pipeline.

A stage is a tree of processes the pipeline did not write: a launcher's bash, torchrun and its ranks (each in a
session of its own, tied to torchrun by ``lifetime.tie_rank_to_launcher``), a vLLM server and its engine processes.
When the pipeline is killed with SIGKILL nothing of its own code runs, so the keeper asks the kernel for a SIGTERM
at that moment (``PR_SET_PDEATHSIG``) and stops the stage as a terminal's Ctrl-C would: the signal goes to the
command's whole process group (torchrun forwards it to the ranks, which save), and whatever is left when the grace
period since that signal ends is killed, whether or not the command has exited. A signal from the pipeline itself
takes the same path; SIGUSR1, SLURM's pre-timeout warning, goes to the command alone (the launcher traps it,
forwards it to srun and requeues the job).

    python -m megatron_mimesis.pipeline.keeper GRACE_S PIPELINE_PID -- COMMAND [ARG ...]
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
USAGE = "usage: python -m megatron_mimesis.pipeline.keeper GRACE_S PIPELINE_PID -- COMMAND [ARG ...]"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_group(pgid: int, deadline: float) -> None:
    """Wait until ``deadline`` (monotonic) for the process group to empty, then SIGKILL what is left of it."""
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    grace_s, parent, separator, *command = argv
    if separator != "--" or not command:
        print(USAGE, file=sys.stderr)
        return 2
    child = None
    deadline = []  # set by the first stop signal: the grace runs from the stop, not from the command's exit

    def forward(signum, _frame):
        if signum == signal.SIGUSR1:
            if child is not None:
                os.kill(child.pid, signum)
            return
        if not deadline:
            deadline.append(time.monotonic() + float(grace_s))
        if child is not None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    # the handlers come before the death signal is asked for, so that it never meets Python's default (death)
    for signum in (*STOP_SIGNALS, signal.SIGUSR1):
        signal.signal(signum, forward)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    # the pipeline's pid comes from the pipeline: read here, getppid() would already be init's if it died before
    if os.getppid() != int(parent) or deadline:
        return 1
    child = subprocess.Popen(command, process_group=0)
    if deadline:  # stopped while the command started
        os.killpg(child.pid, signal.SIGTERM)
    # A stopped command gets its grace and no more: a rank blocked in a step (rollouts retrying a user model that
    # was stopped beside it) would otherwise hold the keeper, and with it the whole stage, past the pipeline's death.
    # SIGKILL of the group ends the launcher and torchrun; the ranks, in sessions of their own, die with torchrun.
    while True:
        try:
            status = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if deadline and time.monotonic() >= deadline[0]:
                reap_group(child.pid, 0)
    # the command is done; its group may still hold processes it left (a server's engine, a rank's helper)
    reap_group(child.pid, deadline[0] if deadline else time.monotonic() + 5.0)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""How a failing rank ends: at once, with one line that names the error, and its helpers with it.

Python's own exit path is not prompt enough for a rank. It terminates daemonic children with SIGTERM and then
joins them, and the DataLoader workers ignore SIGTERM (torchrun and srun deliver a preemption signal to the rank's
whole process group; a worker that died of it would make the rank raise before it saves): so a rank that raised
after its loaders started printed its traceback and then waited forever in ``join``, torchrun waited for it, and a
cluster job held its nodes until the time limit. :func:`exit_now` kills the rank's helper processes (loader
workers, a checkpoint writer in flight: nothing of theirs is needed once the rank has failed, and an unfinished
checkpoint is never published) and leaves without the exit handlers, which may also block on peers that are gone
(a process group's teardown).

The line: megatron-core and torch wrap an I/O failure several times (torch's ``CheckpointException`` holds each
rank's failure, megatron-core re-raises it as ``RuntimeError("Worker failure: ...")``), so :func:`root_cause`
digs out the ``OSError`` a user can act on ("No space left on device", "Permission denied") for the message.
"""

import multiprocessing
import os
import signal
import sys
from typing import NoReturn


def root_cause(exc: BaseException) -> BaseException:
    """The first ``OSError`` among ``exc`` and its causes (breadth first, into torch's per-rank checkpoint
    failures); else the first rank's failure inside a ``CheckpointException``; else ``exc`` itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen, pending, fallback = set(), [exc], exc
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        if isinstance(current, CheckpointException):
            failures = [failure for failure, _ in current.failures.values()]
            if failures and fallback is exc:
                fallback = failures[0]
            pending += failures
        pending += [current.__cause__, current.__context__]
    return fallback


def one_line(exc: BaseException) -> str:
    """``exc`` in one line: its type and first line, and its root cause when that is another error."""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    cause = root_cause(exc)
    if cause is not exc and str(cause) not in text:
        text += f" ({type(cause).__name__}: {cause})"
    return text


def exit_now(status: int) -> NoReturn:
    """End this process with ``status`` now: kill its helper processes, flush its output, skip the exit handlers."""
    for child in multiprocessing.active_children():
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)

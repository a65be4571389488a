"""A hard limit on one ``generate`` call (``generation_timeout_s``): a hung rollout ends the run with an error
that says what hung, instead of leaving the job idle until SLURM kills it.

A generate call can block where nothing interrupts it: a CUDA kernel, an NCCL collective waiting for a peer that
went away, a remote endpoint. No exception can be raised into such a thread, so a watchdog thread ends the whole
process: one error line naming the limit and the engine, every thread's Python stack on stderr (where it hung),
then ``os._exit`` with a non-zero code; torchrun sees the failed rank and tears down the others.
"""

import faulthandler
import functools
import os
import sys
import threading
from contextlib import contextmanager

EXIT_CODE = 124  # what timeout(1) exits with


@contextmanager
def watchdog(timeout_s: float, what: str):
    """Kill the process if the body runs longer than ``timeout_s`` seconds."""
    done = threading.Event()

    def expire():
        if done.wait(timeout_s):
            return
        rank = os.environ.get("RANK")
        where = f" on rank {rank}" if rank is not None else ""
        sys.stdout.flush()
        print(f"error: {what} ran longer than generation_timeout_s={timeout_s:g}s{where}; all thread stacks "
              f"follow, then the process exits with code {EXIT_CODE}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(EXIT_CODE)

    threading.Thread(target=expire, name="generation-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def add_generation_timeout(engine, timeout_s: float | None):
    """``engine`` itself, its ``generate`` now under a watchdog; unchanged when ``timeout_s`` is None. The engine
    is patched rather than wrapped so that code checking which engine it has (``refresh_engine``) still sees it."""
    if timeout_s is None:
        return engine
    generate = engine.generate
    what = f"{type(engine).__name__}.generate"

    @functools.wraps(generate)
    def generate_with_timeout(prompts, sampling):
        with watchdog(timeout_s, what):
            return generate(prompts, sampling)

    engine.generate = generate_with_timeout
    return engine

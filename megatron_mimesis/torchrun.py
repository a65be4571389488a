"""torchrun as the launchers run it (``python -m megatron_mimesis.torchrun``, torchrun's own arguments): the same
agent, except that a stop signal it was asked to handle (``--signals-to-handle``: SLURM's SIGUSR1, a SIGTERM) ends it
with one line instead of torch's traceback. torchrun forwards the signal to the ranks, which save and stop, and then
raises ``SignalException`` through its ``main``: each node printed some 30 lines of traceback into a job's output at
every preemption. The exit status stays non-zero (128 + the signal), so that the launcher still reads the ranks'
exit record to tell a preemption that saved from a failure (``launch/common.sh``: ``launch_status``); a failing rank
is reported by torchrun as before.
"""

import os
import signal
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as exc:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        print(f"torchrun on {node}: {signal.Signals(exc.sigval).name}: its ranks were told to stop",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

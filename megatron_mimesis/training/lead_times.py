"""How long before its time limit a SLURM job must be told to stop, and how long torchrun then gives the ranks: the
one source of ``#SBATCH --signal=B:USR1@T`` and ``SHUTDOWN_TIMEOUT`` in ``launch/slurm/*.sbatch`` (a test checks
that they agree; ``mimesis-plan``/``--dry-run`` print the busiest node's share of a checkpoint and the write time they
come from).

After the signal a rank first reaches the loop's next stop point (the end of a training step; in RL the end of the
phase it is in: a generation batch, the scoring, the teacher, the update), then waits for a periodic checkpoint
still being written, writes the stop's checkpoint and publishes it. So::

    SHUTDOWN_TIMEOUT = longest wait for a stop point + 2 x planned save time + PUBLISH_MARGIN_S
    --signal lead    = SHUTDOWN_TIMEOUT + REQUEUE_MARGIN_S

each rounded up to a minute, the save time that of the node that writes the most of a checkpoint, at the stated
filesystem bandwidth (``memory/checkpoint.py``, ``ckpt_write_gb_per_s``).
"""

import math

# The longest a rank of each stage's 9B config runs between two stop points, at the paper's throughput.
LONGEST_WAIT_S = {
    "midtrain": 90,  # one step: ~30 s at 40% MFU, ~90 s at the paper's 12% (80 x 24576 tokens on 32 A100s)
    "sft": 90,  # one step of the same size on one node's 8 A100s at the SFT batch
    "rl_simulator": 300,  # one turn's generate call (16 prompts x 8 rollouts of up to 2k tokens), or the update
    "rl_agent": 300,  # one round of agent and user generate calls, the coach's teacher pass, or the update
}
PUBLISH_MARGIN_S = 60  # files.json, the rename and `latest`; the forked writer's exit and the ranks' teardown
REQUEUE_MARGIN_S = 120  # srun relaying the end, scontrol requeue, and the batch shell's exit before the limit


def _minutes(seconds: float) -> int:
    return 60 * math.ceil(seconds / 60)


def lead_times(stage: str, save_seconds: float) -> tuple[int, int]:
    """(--signal lead, SHUTDOWN_TIMEOUT) in seconds for ``stage`` writing each checkpoint in ``save_seconds``."""
    shutdown = _minutes(LONGEST_WAIT_S[stage] + 2 * save_seconds + PUBLISH_MARGIN_S)
    return _minutes(shutdown + REQUEUE_MARGIN_S), shutdown

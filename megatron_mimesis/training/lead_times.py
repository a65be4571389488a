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
    # one round of agent and user generate calls, the old log-probs or the teacher pass, or the update, which is one
    # phase: at the paper's batch (64 tasks x 8 rollouts, ~15 turns of up to 32k-token contexts, ~15M tokens) ~300 s
    # to 640 s at 40-50% MFU on 16 A100s. The RL loop logs each step's longest phase (longest_phase_s) and warns once
    # when one outlasts this (lead_warning)
    "rl_agent": 600,
}
PUBLISH_MARGIN_S = 60  # files.json, the rename and `latest`; the forked writer's exit and the ranks' teardown
REQUEUE_MARGIN_S = 120  # srun relaying the end, scontrol requeue, and the batch shell's exit before the limit


def _minutes(seconds: float) -> int:
    return 60 * math.ceil(seconds / 60)


def lead_warning(stage: str, longest_phase_s: float) -> str | None:
    """The line a run prints when a phase between two stop points took longer than the lead times assume (a
    preemption then may not leave the time to save); None while it does not."""
    assumed = LONGEST_WAIT_S[stage]
    if longest_phase_s <= assumed:
        return None
    return (f"a phase took {longest_phase_s:.0f} s between two stop points, above the {assumed} s the SLURM lead times "
            f"assume for {stage} (training/lead_times.py): lengthen --signal=B:USR1@ and SHUTDOWN_TIMEOUT by "
            f"{_minutes(longest_phase_s - assumed)} s, or a preemption may not save")


def lead_times(stage: str, save_seconds: float) -> tuple[int, int]:
    """(--signal lead, SHUTDOWN_TIMEOUT) in seconds for ``stage`` writing each checkpoint in ``save_seconds``."""
    shutdown = _minutes(LONGEST_WAIT_S[stage] + 2 * save_seconds + PUBLISH_MARGIN_S)
    return _minutes(shutdown + REQUEUE_MARGIN_S), shutdown

"""Preemption: SLURM sends SIGUSR1 (``--signal``) or SIGTERM before killing a job. The handler only sets a
flag; the loop saves a checkpoint at the end of the current step (in RL, also between the phases of a step: the last
complete one) and exits so the job can be requeued."""

import signal

import torch
import torch.distributed as dist


class ExitSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def any_rank_received(self, group=None) -> bool:
        """True on every rank of ``group`` (the world by default) once any of them got a signal: ranks must leave
        the loop at the same point. Collective over the group."""
        from megatron_mimesis.compat import compute_device

        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=compute_device())
        if group is None or dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

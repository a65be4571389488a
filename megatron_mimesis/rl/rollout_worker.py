"""Rollouts generated while the trainer trains (``max_staleness``): the step after next is being played while this
one's update runs, as veRL's fully-async mode, AReaL and prime-rl overlap them.

A worker thread plays the steps in order (sample the step's tasks, run the episodes, score them) on the rollout
engine's own copy of the policy, and hands each step's rollouts to the trainer, which takes them in the same order.
Step ``j`` may start once the trainer has published policy version ``j - max_staleness`` (its weights after that many
updates); the trainer trains step ``j`` at version ``j``, so no sampled token lags the weights that train on it by more
than ``max_staleness`` versions (AReaL's bound; veRL's ``staleness_threshold``). 0 makes the worker wait for every
update: the two sides take turns, as the synchronous loop does.

New weights reach the engine between two of its generate calls (:class:`VersionedEngine`): every call samples with
one version, which each generation records, so a multi-turn episode may span versions turn by turn, and the update
knows each row's staleness. The trainer never waits for the rollouts in flight to finish before an update; it waits
only for the generate call in progress to release the engine.

The worker never touches the trainer's process groups (a group serves one thread). At model-parallel size 1 it makes
no collective call at all; above it (a served engine, whose requests the group's first rank sends) the workers of a
model-parallel group broadcast the answers and agree on every stop over a gloo copy of the group (``group``), so they
play in lockstep and end at the same point. The trainer's next stop point drops a step whose rollouts a signal cut
short. On a stop the rollouts in flight are abandoned: the checkpoint holds the task sampler's position at the first
step not yet trained, and the requeued run plays those steps again, none lost, none trained twice.
"""

import queue
import threading
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist


class RolloutWorkerError(RuntimeError):
    """The worker's step raised; the trainer raises this, naming the step, with the worker's error as its cause."""


class WorkerClosed(Exception):
    """The worker ended before the step: a trainer of its group closed it (the trainer that waits for the step must
    not wait forever)."""


class VersionedEngine:
    """A rollout engine over its own copy of the policy whose weights change only between two generate calls.

    A started update goes before the next call: the worker plays its calls back to back, and the trainer would
    otherwise wait through a whole step of them. The callers of one model-parallel group (``group``, whose calls
    are collective) agree before each call on the updates started on any of their ranks and all wait for those:
    a caller that went on alone would wait in the call for a peer that waits for its update, whose trainer waits
    at the update's barrier for this caller's trainer, which waits for this caller's call to end."""

    def __init__(self, engine, group=None):
        self.engine, self.group = engine, group
        self.version = 0
        self._turns = threading.Condition()
        self._generating = False
        self._started = self._done = 0  # weight updates begun, and finished, on this rank
        self._longest_call_s = 0.0

    def generate(self, prompts, sampling):
        with self._turns:
            started = self._started
        updates = group_max(started, self.group)
        with self._turns:
            self._turns.wait_for(lambda: self._done >= updates and not self._generating)
            self._generating = True
            version = self.version
        start = time.perf_counter()
        try:
            generations = self.engine.generate(prompts, sampling)
        finally:
            with self._turns:
                self._generating = False
                self._longest_call_s = max(self._longest_call_s, time.perf_counter() - start)
                self._turns.notify_all()
        return [replace(g, policy_version=version) for g in generations]

    def longest_call_s(self) -> float:
        """The longest generate call since the last time this was asked: what a stop waits for when it closes the
        worker, beside the trainer's own phases (the lead times cover the longest of them)."""
        with self._turns:
            longest, self._longest_call_s = self._longest_call_s, 0.0
        return longest

    def publish(self, load_weights, version: int) -> float:
        """``load_weights()`` (the trainer's weights into the engine) once no generate call runs, as ``version``;
        returns the seconds the trainer waited for the call in progress."""
        start = time.perf_counter()
        with self._turns:
            self._started += 1
            self._turns.wait_for(lambda: not self._generating)
        waited = time.perf_counter() - start
        try:
            load_weights()
            self.version = version
        finally:
            with self._turns:
                self._done += 1
                self._turns.notify_all()
        return waited

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()


def group_max(value: int, group) -> int:
    """The largest ``value`` over the ranks of ``group``: collective over it when it has several ranks."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


@dataclass
class RolloutBatch:
    step: int
    rollouts: object  # what the stage's ``generate`` returned
    sampler_after: dict  # the task sampler's position once this step's tasks are drawn: the next step's start
    gate_wait_s: float  # how long the step waited for the trainer's version before it could start


class WorkerChecks:
    """What the stages' ``generate`` asks between its phases, answered off the trainer's groups: stop points are the
    trainer's (it calls its own after taking the batch), and rollouts end early once a rank of ``group`` got a
    preemption signal or its trainer closed the worker."""

    def __init__(self, exit_signal, closing: threading.Event, group):
        self.exit_signal, self.closing, self.group = exit_signal, closing, group

    def stop_point(self, phase: str) -> None:
        pass

    def rollouts_must_stop(self) -> bool:
        return self.any_rank(self.closing.is_set() or (self.exit_signal is not None and
                                                        self.exit_signal.received is not None))

    def any_rank(self, flag: bool) -> bool:
        """``flag`` on any rank of the group: collective over it when it has several ranks."""
        return bool(group_max(int(flag), self.group))


class RolloutWorker:
    """Plays steps ``first_step``, ``first_step + 1``, ... with ``generate(step, checks)`` on a thread, each once the
    trainer's published version allows it; :meth:`next_batch` hands them over in order."""

    def __init__(self, generate, sampler, max_staleness: int, first_step: int, last_step: int, exit_signal,
                 group=None):
        self.generate, self.sampler, self.max_staleness = generate, sampler, max_staleness
        self._version = first_step
        self._gate = threading.Condition()
        self._closing = threading.Event()
        self._checks = WorkerChecks(exit_signal, self._closing, group)
        self._batches: queue.Queue = queue.Queue()
        self._idle_s, self._waiting_since = 0.0, None
        self._thread = threading.Thread(target=self._play, args=(first_step, last_step), name="rollout-worker",
                                        daemon=True)
        self._thread.start()

    def _play(self, first_step: int, last_step: int) -> None:
        from megatron_mimesis.compat import enable_cpu_compat_in_thread

        enable_cpu_compat_in_thread()
        for step in range(first_step, last_step):
            with self._gate:
                self._waiting_since = time.perf_counter()
                self._gate.wait_for(lambda s=step: self._closing.is_set() or self._version >= s - self.max_staleness)
                waited = time.perf_counter() - self._waiting_since
                self._idle_s += waited
                self._waiting_since = None
            try:
                if self._checks.any_rank(self._closing.is_set()):  # the group's workers end together
                    self._batches.put((step, WorkerClosed("a rank of its model-parallel group ended the run")))
                    return
                rollouts = self.generate(step, self._checks)
            except BaseException as error:  # handed to the trainer, which raises it
                self._batches.put((step, error))
                return
            self._batches.put(RolloutBatch(step, rollouts, self.sampler.state_dict(), waited))
        with self._gate:  # the last step is played: the worker idles from here on
            self._waiting_since = time.perf_counter()

    def next_batch(self, step: int) -> RolloutBatch:
        """Step ``step``'s rollouts, once played (the steps come in order)."""
        batch = self._batches.get()
        if isinstance(batch, tuple):
            failed, error = batch
            raise RolloutWorkerError(f"the rollout worker failed in iteration {failed + 1}: "
                                     f"{type(error).__name__}: {error}") from error
        if batch.step != step:
            raise RuntimeError(f"the rollout worker handed over step {batch.step} where step {step} was due")
        return batch

    def published(self, version: int) -> None:
        """The trainer's weights after ``version`` updates are in the engine: steps up to ``version +
        max_staleness`` may start."""
        with self._gate:
            self._version = version
            self._gate.notify_all()

    def idle_s(self, now: float) -> float:
        """The seconds the worker has waited for the trainer until ``now`` (``time.perf_counter()``), the wait in
        progress included."""
        with self._gate:
            return self._idle_s + (now - self._waiting_since if self._waiting_since else 0.0)

    def abandon(self) -> None:
        """Tell the worker to end after its generate call in progress, without waiting for it."""
        self._closing.set()
        with self._gate:
            self._gate.notify_all()

    def close(self) -> None:
        """Abandon the rollouts in flight, and wait for the worker to end (its generate call in progress)."""
        self.abandon()
        self._thread.join()

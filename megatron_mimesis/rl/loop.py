"""What both RL stages share around their step: the trainer, the rollout engine, the process-group roles, and
the run (restore, log, checkpoint with the task sampler's position, stop on signals), so simulator RL and agent
RL differ only in their step's two halves: ``generate`` (draw the step's tasks, play and score them) and ``train``
(the rows, their old log-probs, the update). The synchronous loop runs one after the other; with ``max_staleness``
set a rollout worker runs ``generate`` of the next steps while this one trains (``rollout_worker.py``).

Inside a model-parallel group (TP x PP) every rank must see the same rollouts, so anything that may call a
remote endpoint (a counterpart, a judge, a coach, a user model) runs on the group's first rank and its answer
is broadcast (``on_group_leader``).
"""

import math
import time
from collections import Counter

import torch
import torch.distributed as dist

from megatron_mimesis.training.config import ConfigError

# Steps a run's sampling seeds stay apart for, per --seed: run seeds s and s + 1 never sample a step alike below it.
STEPS_PER_SEED = 1_000_000


class StepAbandoned(Exception):
    """A preemption signal reached a rank in the middle of a step: every rank drops the step at the same point."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


def copy_of_group(group):
    """A gloo group of the same ranks as ``group`` (this rank's), for another thread's collectives: ranks of one
    group must issue its collectives in one order, which two threads cannot promise. Collective over the world."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dist.get_process_group_ranks(group))
    copy = None
    for ranks in sorted({tuple(ranks) for ranks in every}):
        created = dist.new_group(list(ranks), backend="gloo")
        if dist.get_rank() in ranks:
            copy = created
    return copy


def on_group_leader(fn, group):
    """Run ``fn`` on the group's first rank and give its result to every rank of the group."""
    if group is None or dist.get_world_size(group) == 1:
        return fn()
    payload = [fn() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    return payload[0]


class RLLoop:
    """Subclasses set ``self.sampler`` (``state_dict``/``load_state_dict``) and ``headline``, and define
    ``generate(step, checks)`` (the step's tasks drawn, played and scored; ``checks`` gives the stop points) and
    ``train(step, rollouts)`` (the update on them, at policy version ``step``; returns the step's record)."""

    headline: tuple[str, ...] = ()

    def __init__(self, config):
        from megatron.core import parallel_state
        from transformers import AutoTokenizer

        from megatron_mimesis.rl.engines.factory import build_rollout_engine
        from megatron_mimesis.training.train import Trainer

        self.config = config
        self.trainer = Trainer(config, tokenizer_dir=config.tokenizer)
        self.device = self.trainer.device
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.mp_group = parallel_state.get_model_parallel_group()
        # the group whose first rank calls the endpoints while rollouts are played: the model-parallel group, or
        # with a rollout worker at model-parallel size > 1 a copy of it, since a group serves one thread
        self.rollout_group = self.mp_group
        if config.max_staleness is not None and dist.get_world_size(self.mp_group) > 1:
            self.rollout_group = copy_of_group(self.mp_group)
        self.engine = build_rollout_engine(config, self.trainer, self.tokenizer, self.rollout_group)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.reference = self.frozen_copy(config.kl_reference) if config.kl_coef else None
        self.exit_signal = None  # set by run when the config handles preemption signals
        self.worker = None  # the rollout worker, while run runs one (max_staleness)
        self._phase_start, self._longest_phase = time.perf_counter(), 0.0  # between two stop points of a step

    def frozen_copy(self, source: str) -> list:
        """Another model of the policy's architecture and layout with its own weights (an HF directory or a dist
        checkpoint), frozen: the KL reference, or a local user simulator."""
        from pathlib import Path

        from megatron_mimesis.checkpoint.trainer_state import load_model_weights
        from megatron_mimesis.rl.engines.factory import policy_copy

        chunks = policy_copy(self.trainer)
        if (Path(source) / "config.json").exists():
            self.trainer.load_hf(chunks, source)
        else:
            load_model_weights(source, chunks, self.config.preset)
        return chunks

    def loss_config(self, **extra):
        from megatron_mimesis.rl.update.policy_step import PolicyLossConfig

        c = self.config
        return PolicyLossConfig(clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high, dual_clip_c=c.dual_clip_c,
                                kl_coef=c.kl_coef, **extra)

    def step_seed(self, step: int) -> int:
        """The sampling seed of this data-parallel rank's rollouts in ``step``: distinct per rank and step, and per
        run ``seed`` (``--seed``), non-negative; the episode runners derive every request's seed from it."""
        return (self.config.seed * STEPS_PER_SEED + step) * self.dp_size + self.dp_rank

    def my_share(self, items: list) -> tuple[list, int]:
        """This data-parallel rank's slice of the step's prompts/tasks and its offset (for globally unique ids)."""
        share = len(items) // self.dp_size
        return items[self.dp_rank * share:(self.dp_rank + 1) * share], self.dp_rank * share

    def stop_point(self, phase: str) -> None:
        """Between two phases of a step: drop the step, on every rank together, when a preemption signal reached any
        rank; the run then saves the last complete step at once instead of finishing this one (an RL step outlasts
        SLURM's pre-timeout warning). Collective over all ranks."""
        self._phase_ended()
        if self.exit_signal is not None and self.exit_signal.any_rank_received():
            raise StepAbandoned(phase)

    def rollouts_must_stop(self) -> bool:
        """After each generation batch: whether a preemption signal reached a rank of this model-parallel group,
        whose ranks generate in lockstep, so that its rollouts end there (the next :meth:`stop_point` drops the
        step). Collective over the model-parallel group."""
        self._phase_ended()
        return self.exit_signal is not None and self.exit_signal.any_rank_received(self.mp_group)

    def _phase_ended(self) -> None:
        """A stop point was reached: the time since the previous one is what a preemption signal may have to wait."""
        now = time.perf_counter()
        self._longest_phase = max(self._longest_phase, now - self._phase_start)
        self._phase_start = now

    def replica_spread(self, seconds: float) -> dict:
        """The slowest data-parallel replica's rollout time and its lead over the fastest: what the replicas wait
        for each other in the next collective, which ``distributed_timeout_minutes`` must exceed."""
        times = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(times) for _ in range(self.dp_size)]
        dist.all_gather(every, times, group=self.dp_group)
        every = torch.cat(every)
        return {"rollout_time_max_s": every.max().item(), "rollout_time_spread_s": (every.max() - every.min()).item()}

    def step(self, step: int) -> dict:
        """One synchronous step: its rollouts, then its update."""
        return self.train(step, self.generate(step, self))

    def on_policy_rows(self, rows: list, version: int) -> tuple[list, dict]:
        """The rows with the update's old log-probs, and the record of their staleness (with a rollout worker).

        With ``off_policy_loss: decoupled`` the old log-probs are the trainer's own, at ``version``: as sampled when
        the engine is the training model, or the worker's copy of it at that version; else recomputed, the sampler's
        kept beside them for the rollout correction. With ``behaviour`` they are the sampler's. Every consumer of the
        student's log-probs (the update, the CSD gate, the placebo correction) reads these."""
        from megatron_mimesis.rl.engines.factory import samples_with_policy_copy, samples_with_training_model
        from megatron_mimesis.rl.update.scoring import recompute_old_logprobs

        record = self._staleness(rows, version) if self.worker is not None else {}
        if samples_with_training_model(self.engine, self.trainer) or self.config.off_policy_loss == "behaviour":
            return rows, record
        copy = samples_with_policy_copy(self.engine)
        redo = [i for i, row in enumerate(rows) if not (copy and row.policy_version == version)]
        rows = list(rows)
        recomputed = recompute_old_logprobs(self.trainer.model, [rows[i] for i in redo],
                                            self.config.max_tokens_per_microbatch, self.device)
        for i, row in zip(redo, recomputed, strict=True):
            rows[i] = row
        return rows, record

    def _staleness(self, rows: list, version: int) -> dict:
        """The step's rows by how many versions their sampler lagged the trainer's ``version``, over every
        data-parallel rank. The worker starts a step only within the bound, so a row past it is a defect."""
        bound = self.config.max_staleness
        lags = [version - row.policy_version for row in rows]
        if any(not 0 <= lag <= bound for lag in lags):
            raise RuntimeError(f"rows sampled {sorted(set(lags))} versions behind the trainer's version {version}, "
                               f"outside max_staleness {bound}")
        counts = torch.bincount(torch.tensor(lags, dtype=torch.long), minlength=bound + 1).double().to(self.device)
        dist.all_reduce(counts, group=self.dp_group)
        counts = counts.tolist()
        return {**{f"staleness/{lag}": int(n) for lag, n in enumerate(counts)},
                "staleness_mean": sum(lag * n for lag, n in enumerate(counts)) / max(sum(counts), 1)}

    def gather_and_update(self, rows: list, summaries: list[dict], loss_config, teacher=None,
                          advantages=None) -> tuple[dict, list]:
        """Gather every data-parallel rank's rows (as tensors: ``update/rows.py``) and rollout summaries
        (``{"group_id", "reward", ...}``), drop groups with fewer than ``min_valid_rollouts`` scored rollouts
        (counted), compute advantages over unique rollouts, weigh the tokens for the engine they were sampled from
        (rollout correction, with the mismatch metrics over all rows), take ``optimizer_steps_per_batch`` optimizer
        steps. ``teacher``: per-row teacher log-probs (CSD). ``rows`` come from
        :meth:`on_policy_rows`; with a KL term each rank first scores its own rows under the reference.
        ``advantages(rows)``: one advantage per kept row (default: FoldGRPO's over the rows' rewards). Returns the
        update's record and all ranks' summaries.

        The advantages come from the rewards of every kept rollout before any weighting: a token or row the
        correction masks still counts in its group's statistics (FoldGRPO's mean and std over unique rollouts).
        Several optimizer steps split the batch by group into that many mini-batches (PPO's, as veRL takes them),
        every step against the old log-probs of the rollouts, so from the second step on the clip acts; the
        learning-rate schedule advances once per batch. The engine takes the new weights after the step (``run``)."""
        from megatron_mimesis.rl.update.policy_step import policy_update
        from megatron_mimesis.rl.update.rollout_correction import rollout_weights
        from megatron_mimesis.rl.update.rows import StepRows
        from megatron_mimesis.rl.update.scoring import score_rows

        c = self.config
        ref = None
        if self.reference is not None:
            ref = score_rows(self.reference, [(r.context_ids, r.response_ids) for r in rows],
                             c.max_tokens_per_microbatch, self.device)
        step = StepRows.of_rows(rows, teacher, ref).gathered(self.dp_group, self.device)
        gathered = [None] * self.dp_size
        dist.all_gather_object(gathered, summaries, group=self.dp_group)
        summaries = [s for part in gathered for s in part]
        valid_per_group = Counter(s["group_id"] for s in summaries if s["reward"] is not None)
        keep = torch.tensor([valid_per_group[g] >= c.min_valid_rollouts for g in step.group_ids.tolist()],
                            dtype=torch.bool, device=step.lengths.device)
        weights, correction = rollout_weights(step, c.rollout_correction, c.rollout_correction_level,
                                              c.rollout_correction_cap)
        if weights is not None:
            step = step.with_response("rollout_weights", weights)
            if not weights[keep[step.response_row_index()]].any():
                keep[:] = False  # the correction rejected every token: an optimizer step on nothing would still move Adam
        record = {"rows": len(step), "rows_trained": int(keep.sum()),
                  "groups_without_gradient": len(set(step.group_ids.tolist()) - set(step.group_ids[keep].tolist())),
                  **correction}
        if not keep.any():
            record["update_applied"] = False
            return record, summaries
        kept = step.select(keep)
        kept_advantages = (advantages or foldgrpo)(kept)
        start = time.perf_counter()
        results = []
        for part in minibatch_groups(kept.group_ids, c.optimizer_steps_per_batch):
            results.append(policy_update(self.trainer.model, self.trainer.optimizer, kept.select(part),
                                         kept_advantages[part], loss_config, c.max_tokens_per_microbatch,
                                         self.device))
        if any(r["update_applied"] for r in results):
            self.trainer.scheduler.step(increment=1)
        record.update(merged_steps(results))
        record["train_time_s"] = time.perf_counter() - start
        record["train_tokens_per_s"] = int(kept.lengths.sum()) / record["train_time_s"]
        record["advantage_abs_mean"] = kept_advantages.abs().double().mean().item()
        return record, summaries

    def run(self) -> int:
        from megatron_mimesis.checkpoint.trainer_state import current_layout
        from megatron_mimesis.models.presets import preset_record
        from megatron_mimesis.rl.update.rollout_correction import correction_warning
        from megatron_mimesis.training.lead_times import lead_warning
        from megatron_mimesis.training.run_log import RunLog
        from megatron_mimesis.training.signals import ExitSignal
        from megatron_mimesis.training.train import save_and_maybe_stop, save_final

        c = self.config
        progress = self.trainer.restore({"iteration": 0, "sampler": self.sampler.state_dict()})
        if "sampler" not in progress:
            raise ConfigError(f"load: {c.load} is not a {c.stage} checkpoint; start from it with --finetune")
        self.sampler.load_state_dict(progress["sampler"])
        self._publish(progress["iteration"])  # the engine was built before the weights were restored
        run_config = {"train": c.to_dict(), "preset": preset_record(c.preset), "layout": current_layout(),
                      "padded_vocab_size": self.trainer.provider.padded_vocab_size}
        self.log = RunLog(c.log_dir, c.train_iters, progress["iteration"], enabled=self.trainer.is_logger,
                          progress=c.progress, wandb_project=c.wandb_project, run_config=run_config,
                          headline=self.headline, resumed_from=self.trainer.resumed_from)
        self.exit_signal = exit_signal = ExitSignal() if c.exit_signal_handler else None
        position = progress["sampler"]  # the task sampler's position at the start of the first step not trained

        def save():
            progress["sampler"] = position
            self.trainer.save_checkpoint(progress, run_config)

        if c.max_staleness is not None:
            from megatron_mimesis.rl.rollout_worker import RolloutWorker

            self.worker = RolloutWorker(self.generate, self.sampler, c.max_staleness, progress["iteration"],
                                        c.train_iters, exit_signal, self.rollout_group)
        stop = None
        warned = False
        clock = _StepClock(self.worker)
        try:
            while progress["iteration"] < c.train_iters:
                self._phase_start, self._longest_phase = time.perf_counter(), 0.0
                try:
                    record, next_position = self._one_step(progress["iteration"])
                    record.update(self._publish(progress["iteration"] + 1))
                    self._phase_ended()  # the last phase: the update and the engine's refresh
                except StepAbandoned as abandoned:
                    it = progress["iteration"]
                    unsaved = self.trainer.checkpoints is not None and it > 0 and not self.trainer.has_saved(it)
                    self.log.message(f"exit signal received during iteration {it + 1} (after its {abandoned.phase}): "
                                     f"stopping at iteration {it}, the last complete step"
                                     f"{', saving it,' * bool(unsaved)} for requeue")
                    if unsaved:
                        save()  # the requeued run samples this step's tasks again
                    stop = "signal"
                    break
                self.trainer.poll_checkpoint()
                progress["iteration"] += 1
                it = progress["iteration"]
                position = next_position
                # the trainer's idle time: waiting for the step's rollouts, and for the engine to take the weights
                record.update(clock.tick(record.pop("trainer_wait_s", 0.0) + record.get("weight_sync_wait_s", 0.0)))
                if self.worker is not None:  # a stop also waits for the worker's generate call in progress
                    self._longest_phase = max(self._longest_phase, self.engine.longest_call_s())
                # the longest on any rank: what a signal waits for is the slowest rank's phase
                longest = torch.tensor([self._longest_phase], dtype=torch.float64, device=self.device)
                dist.all_reduce(longest, op=dist.ReduceOp.MAX)
                record["longest_phase_s"] = longest.item()
                self.log.step({"iteration": it, **record})
                warning = None if warned else lead_warning(c.stage, record["longest_phase_s"])
                if warning:  # once a run
                    self.log.message(f"step {it}: {warning}")
                    warned = True
                warning = correction_warning(record, c.rollout_correction, c.rollout_correction_cap,
                                             c.rollout_correction_warn_frac)
                if warning:
                    self.log.message(f"step {it}: {warning}")
                stop = save_and_maybe_stop(c, it, exit_signal, self.log, save)
                if stop:
                    break
            else:
                save_final(c, progress["iteration"], save)
        except BaseException:
            if self.worker is not None:
                self.worker.abandon()  # the process ends: nothing waits for the generate call in progress
            raise
        if self.worker is not None:
            self.worker.close()  # the rollouts in flight are abandoned; the requeued run plays them again
        self.trainer.end_run(self.log, stop, exit_signal, progress["iteration"])
        return 0

    def _one_step(self, step: int) -> tuple[dict, dict]:
        """Step ``step``'s record, and the task sampler's position after its tasks: the next step's start."""
        if self.worker is None:
            return self.step(step), self.sampler.state_dict()
        start = time.perf_counter()
        batch = self.worker.next_batch(step)
        waited = time.perf_counter() - start
        self.stop_point("rollouts")  # a signal may have cut the worker's rollouts short
        record = self.train(step, batch.rollouts)
        record.update(trainer_wait_s=waited, rollout_gate_wait_s=batch.gate_wait_s)
        return record, batch.sampler_after

    def _publish(self, version: int) -> dict:
        """The trainer's weights (``version`` updates in) into an engine that does not sample with them itself, at
        the start and after every step; with a rollout worker between two of its generate calls, after which steps
        up to ``version + max_staleness`` may start."""
        from megatron_mimesis.rl.engines.factory import refresh_engine

        start = time.perf_counter()
        if self.config.max_staleness is None:
            refresh_engine(self.engine, self.trainer, version)
            return {"weight_sync_time_s": time.perf_counter() - start}
        waited = self.engine.publish(lambda: refresh_engine(self.engine.engine, self.trainer, version), version)
        if self.worker is not None:
            self.worker.published(version)
        return {"weight_sync_time_s": time.perf_counter() - start, "weight_sync_wait_s": waited}


class _StepClock:
    """Each side's idle share of a step's wall time (from the previous step's end): the trainer's waits for the
    step's rollouts and for the engine's generate call in progress at the weight update, the rollout worker's wait
    for the trainer's weights."""

    def __init__(self, worker):
        self.worker = worker
        self.last = time.perf_counter()
        self.idle_before = worker.idle_s(self.last) if worker is not None else 0.0

    def tick(self, trainer_wait_s: float) -> dict:
        now = time.perf_counter()
        wall, self.last = now - self.last, now
        if self.worker is None:
            return {"step_time_s": wall}
        idle = self.worker.idle_s(now)
        rollout_wait_s, self.idle_before = idle - self.idle_before, idle
        return {"step_time_s": wall, "trainer_idle_frac": trainer_wait_s / wall,
                "rollout_idle_frac": rollout_wait_s / wall}


def foldgrpo(rows) -> torch.Tensor:
    """FoldGRPO's advantages: each row's reward against its group's statistics over unique rollouts."""
    from megatron_mimesis.kernels import foldgrpo_advantages

    return foldgrpo_advantages(rows.rewards.float(), rows.group_ids, rows.rollout_ids, impl="torch")


def minibatch_groups(group_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Row masks of ``steps`` mini-batches: the groups in order of id, cut into ``steps`` runs whose sizes differ by
    at most one (fewer when there are fewer groups), every row with its group."""
    groups = torch.unique(group_ids)
    return [torch.isin(group_ids, part) for part in torch.tensor_split(groups, min(steps, len(groups)))]


def merged_steps(results: list[dict]) -> dict:
    """The record of a batch's optimizer steps: one step's own; for several, each metric's mean over the steps (the
    clip fractions per step too), the micro-batches summed, applied when every step was."""
    if len(results) == 1:
        return results[0]
    record = {"optimizer_steps": len(results), "update_applied": all(r["update_applied"] for r in results),
              "microbatches": sum(r["microbatches"] for r in results), "lr": results[0]["lr"]}
    for name in results[0]:
        if name not in record:
            values = [r[name] for r in results if r.get(name) is not None]
            record[name] = sum(values) / len(values) if values else None
    for name in ("clip_frac_low", "clip_frac_high", "approx_kl"):
        if name in results[0]:
            record[f"{name}_per_step"] = [r.get(name) for r in results]
    return record


def mean(values):
    return sum(values) / len(values) if values else None


def std(values):
    if len(values) < 2:
        return None
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def rl_main(argv, config_cls, loop_cls, prog: str, description: str) -> int:
    """The RL entry points: parse and validate the config before any process group starts, print it on
    ``--dry-run`` with its memory plan, else run ``loop_cls(config)`` to completion."""
    import os
    import sys

    from megatron_mimesis.compat import prepare_cpu_process
    from megatron_mimesis.lifetime import tie_rank_to_launcher
    from megatron_mimesis.training.config import parse_config
    from megatron_mimesis.training.train import dry_run, run_to_completion, start_run

    prepare_cpu_process()  # before megatron-core is imported: its import warns and applies torch.compile
    tie_rank_to_launcher()
    config, args = parse_config(argv, config_cls, prog=prog, description=description)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config, resuming = config.resolve_start()
        config.validate(world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megatron_mimesis.rl.memory import plan_rl

        resolved = {"config": config.to_dict(), "world_size": world_size, "resuming": resuming,
                    "data_parallel_size": config.data_parallel_size(world_size),
                    "rollouts_per_step": config.rollouts_per_step}
        return dry_run(config, world_size, plan_rl(config, world_size), resolved, args.check_save_dir,
                       args.check_shutdown_timeout, args.check_endpoints)
    if not start_run(config, world_size, resuming):
        return 2
    return run_to_completion(lambda: loop_cls(config).run(), config.log_dir)

"""Simulator RL with FoldGRPO on megatron-core: the whole loop, top to bottom.

    python -m megatron_mimesis.rl.simulator_rl --config FILE [--flag value ...] [--dry-run]   (under torchrun)

Each step: sample prompts by domain weight; every data-parallel rank plays its share of them
``rollouts_per_prompt`` times against the counterpart (multi-turn, the simulator speaking as the user, its
thinking private); score each rollout with its domain's reward; fold every policy turn into a training row;
gather the rows of all data-parallel ranks; compute advantages over *unique rollouts* per group
(``foldgrpo_advantages``), dropping groups with fewer than ``min_valid_rollouts`` scored rollouts; and take
one optimizer step with the fused GRPO loss on the last stage's hidden states. Old log-probs are the
sampler's: the local engine samples with the training model itself, before the update.

Inside a model-parallel group (TP x PP) every rank must see the same rollouts, so the counterpart and the
reward, which may call remote endpoints, run on the group's first rank and their answers are broadcast.
"""

import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mimesis.rl.config import SimulatorRLConfig
from megatron_mimesis.training.config import ConfigError, parse_config


def _on_group_leader(fn, group):
    """Run ``fn`` on the group's first rank and give its result to every rank of the group."""
    if group is None or dist.get_world_size(group) == 1:
        return fn()
    payload = [fn() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    return payload[0]


class _LeaderCounterpart:
    def __init__(self, inner, group):
        self.inner, self.group = inner, group

    def reply_many(self, transcripts):
        return _on_group_leader(lambda: self.inner.reply_many(transcripts), self.group)


class SimulatorRL:
    def __init__(self, config: SimulatorRLConfig):
        from megatron.core import parallel_state
        from transformers import AutoTokenizer

        from megatron_mimesis.rl.chat import ChatRenderer
        from megatron_mimesis.rl.episodes import EpisodeRunner
        from megatron_mimesis.rl.local_engine import LocalEngine
        from megatron_mimesis.rl.prompts import DomainSampler, load_prompts
        from megatron_mimesis.rl.rewards import rewards_for
        from megatron_mimesis.rl.types import SamplingParams
        from megatron_mimesis.training.train import Trainer

        self.config = c = config
        self.trainer = Trainer(c, tokenizer_dir=c.tokenizer)
        self.device = self.trainer.device
        self.tokenizer = AutoTokenizer.from_pretrained(c.tokenizer)
        self.prompts = load_prompts(c.prompts)
        unknown = sorted({p.domain for p in self.prompts} - set(c.domain_rewards))
        if unknown:
            raise ConfigError(f"domain_rewards: no reward for prompt domain(s) {unknown}")
        self.sampler = DomainSampler(self.prompts, c.domain_weights, c.seed)
        self.rewards = rewards_for(c.domain_rewards, c.reward_options)
        self.mp_group = parallel_state.get_model_parallel_group()
        engine = LocalEngine(self.trainer.model, self.tokenizer, len(self.tokenizer), self.device)
        self.runner = EpisodeRunner(
            engine, ChatRenderer(self.tokenizer, thinking=c.thinking),
            _LeaderCounterpart(self._counterpart(), self.mp_group),
            SamplingParams(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p),
            max_turns=c.max_turns, stop_marker=c.stop_marker,
        )
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()

    def _counterpart(self):
        from megatron_mimesis.rl.counterparts import OpenAICounterpart, ScriptedCounterpart

        options = self.config.counterpart_options
        if self.config.counterpart == "scripted":
            return ScriptedCounterpart(lambda transcript, reply=options["reply"]: reply)
        return OpenAICounterpart(**options)

    # ------------------------------------------------------------------ one step
    def _score(self, episodes, prompts_by_id) -> Counter:
        """Rewards per domain in one batch each; a failed score leaves the rollout unscored (reward None)."""
        failures = Counter()
        by_domain = defaultdict(list)
        for e in episodes:
            if not e.finished.startswith("error"):
                by_domain[e.domain].append(e)
        for domain, group in by_domain.items():
            prompts = [prompts_by_id[e.prompt_id] for e in group]
            results = _on_group_leader(lambda g=group, p=prompts, d=domain: self.rewards[d].score_batch(g, p),
                                       self.mp_group)
            for e, r in zip(group, results, strict=True):
                e.reward, e.reward_info = r.value, dict(r.info)
                if r.value is None:
                    failures[f"{domain}: {r.error}"] += 1
        return failures

    def _rollouts(self, step: int):
        """This data-parallel rank's episodes for the step, ids made unique across ranks."""
        c = self.config
        step_prompts = self.sampler.sample(c.prompts_per_step)
        share = c.prompts_per_step // self.dp_size
        mine = step_prompts[self.dp_rank * share:(self.dp_rank + 1) * share]
        episodes = self.runner.run(mine, c.rollouts_per_prompt, step_seed=step * self.dp_size + self.dp_rank)
        for e in episodes:
            e.group_id += self.dp_rank * share
            e.rollout_id += self.dp_rank * share * c.rollouts_per_prompt
        return episodes, {p.id: p for p in mine}

    def step(self, step: int) -> dict:
        from megatron_mimesis.kernels import foldgrpo_advantages
        from megatron_mimesis.rl.episodes import fold_rows
        from megatron_mimesis.rl.policy_step import PolicyLossConfig, policy_update

        c = self.config
        start = time.perf_counter()
        episodes, prompts_by_id = self._rollouts(step)
        reward_failures = self._score(episodes, prompts_by_id)
        rows, fold_stats = fold_rows(episodes)
        rollout_time = time.perf_counter() - start
        gathered = [None] * self.dp_size
        dist.all_gather_object(gathered, (rows, [_summary(e) for e in episodes]), group=self.dp_group)
        rows = [r for part, _ in gathered for r in part]
        summaries = [s for _, part in gathered for s in part]
        valid_per_group = Counter(s["group_id"] for s in summaries if s["reward"] is not None)
        kept = [r for r in rows if valid_per_group[r.group_id] >= c.min_valid_rollouts]
        record = _rollout_metrics(summaries, rows, kept, reward_failures, fold_stats, c)
        record["rollout_time_s"] = rollout_time
        if not kept:
            record["update_applied"] = False
            return record
        advantages = foldgrpo_advantages(
            torch.tensor([r.reward for r in kept], dtype=torch.float32),
            torch.tensor([r.group_id for r in kept]), torch.tensor([r.rollout_id for r in kept]), impl="torch",
        ).tolist()
        start = time.perf_counter()
        update = policy_update(
            self.trainer.model, self.trainer.optimizer, self.trainer.scheduler, kept, advantages,
            PolicyLossConfig(clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high, dual_clip_c=c.dual_clip_c),
            c.max_tokens_per_microbatch, self.device,
        )
        record.update(update)
        record["train_time_s"] = time.perf_counter() - start
        record["advantage_abs_mean"] = sum(abs(a) for a in advantages) / len(advantages)
        return record

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        from megatron_mimesis.training.checkpointing import current_layout, save_checkpoint
        from megatron_mimesis.training.run_log import RunLog
        from megatron_mimesis.training.signals import ExitSignal
        from megatron_mimesis.training.train import save_and_maybe_stop, save_final

        c = self.config
        progress = self.trainer.restore({"iteration": 0, "sampler": self.sampler.state_dict()})
        if "sampler" not in progress:
            raise ConfigError(f"load: {c.load} is not a simulator-RL checkpoint; start from it with --finetune")
        self.sampler.load_state_dict(progress["sampler"])
        run_config = {"train": c.to_dict(), "preset": vars(c.preset), "layout": current_layout(),
                      "padded_vocab_size": self.trainer.provider.padded_vocab_size}
        log = RunLog(c.log_dir, c.train_iters, progress["iteration"], enabled=self.trainer.is_logger,
                     progress=c.progress, wandb_project=c.wandb_project, run_config=run_config,
                     headline=("reward_mean", "pg_loss", "lr"))
        exit_signal = ExitSignal() if c.exit_signal_handler else None

        def save():
            progress["sampler"] = self.sampler.state_dict()
            save_checkpoint(c.save, progress["iteration"], self.trainer.model, self.trainer.optimizer,
                            self.trainer.scheduler, dict(progress), run_config, tokenizer_dir=c.tokenizer)

        while progress["iteration"] < c.train_iters:
            record = self.step(progress["iteration"])
            progress["iteration"] += 1
            it = progress["iteration"]
            log.step({"iteration": it, **record})
            if save_and_maybe_stop(c, it, exit_signal, log, save):
                break
        else:
            save_final(c, progress["iteration"], save)
        log.close()
        return 0


def _summary(episode) -> dict:
    return {"group_id": episode.group_id, "rollout_id": episode.rollout_id, "domain": episode.domain,
            "reward": episode.reward, "finished": episode.finished.split(":")[0], "turns": len(episode.turns),
            "response_tokens": sum(len(t.response_ids) for t in episode.turns)}


def _rollout_metrics(summaries, rows, kept, reward_failures, fold_stats, c) -> dict:
    scored = [s for s in summaries if s["reward"] is not None]
    record = {
        "rollouts": len(summaries), "scored_rollouts": len(scored), "rows": len(rows), "rows_trained": len(kept),
        "groups_without_gradient": len({r.group_id for r in rows} - {r.group_id for r in kept}),
        "reward_failures": sum(reward_failures.values()), "unscored_episodes": fold_stats["unscored_episodes"],
        "reward_mean": _mean([s["reward"] for s in scored]),
        "reward_std": _std([s["reward"] for s in scored]),
        "turns_mean": _mean([s["turns"] for s in summaries]),
        "response_tokens_per_turn": _mean([s["response_tokens"] / max(s["turns"], 1) for s in summaries]),
    }
    for domain in sorted({s["domain"] for s in scored}):
        record[f"reward/{domain}"] = _mean([s["reward"] for s in scored if s["domain"] == domain])
    for reason, count in Counter(s["finished"] for s in summaries).items():
        record[f"finished/{reason}"] = count
    return record


def _mean(values):
    return sum(values) / len(values) if values else None


def _std(values):
    if len(values) < 2:
        return None
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def main(argv: list[str] | None = None) -> int:
    config, args = parse_config(argv, SimulatorRLConfig, prog="python -m megatron_mimesis.rl.simulator_rl",
                                description="Simulator RL (FoldGRPO) of a Qwen3.5 user simulator on megatron-core.")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config.validate(world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps({"config": config.to_dict(), "world_size": world_size,
                          "data_parallel_size": config.data_parallel_size(world_size),
                          "rollouts_per_step": config.prompts_per_step * config.rollouts_per_prompt}, indent=2))
        return 0
    from megatron_mimesis.training.train import run_to_completion

    Path(config.log_dir).mkdir(parents=True, exist_ok=True)
    return run_to_completion(lambda: SimulatorRL(config).run())


if __name__ == "__main__":
    sys.exit(main())

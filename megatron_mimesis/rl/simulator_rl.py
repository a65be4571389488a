"""Simulator RL with FoldGRPO on megatron-core: the whole loop, top to bottom.

    python -m megatron_mimesis.rl.simulator_rl --config FILE [--flag value ...] [--dry-run]   (under torchrun)

Each step: sample prompts by domain weight; every data-parallel rank plays its share of them
``rollouts_per_prompt`` times against the counterpart (multi-turn, the simulator speaking as the user, its
thinking private); score each rollout with its domain's reward; fold every policy turn into a training row;
gather the rows of all data-parallel ranks; compute advantages over *unique rollouts* per group
(``foldgrpo_advantages``), dropping groups with fewer than ``min_valid_rollouts`` scored rollouts; and take
one optimizer step with the fused GRPO loss on the last stage's hidden states. Old log-probs are the training
model's before the update: the local engine's own (it samples with that model), recomputed by the trainer
when vLLM sampled (``update/scoring.recompute_old_logprobs``), and then every token is weighed for having been
drawn from vLLM rather than the trainer (``update/rollout_correction.py``, which logs the mismatch).

What the two RL stages share (the trainer, the engine, the run, the update) is in ``loop.py``.
"""

import sys
import time
from collections import Counter, defaultdict

from megatron_mimesis.rl.loop import RLLoop, mean, on_group_leader, rl_main, std
from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.training.config import ConfigError


class _LeaderCounterpart:
    def __init__(self, inner, group):
        self.inner, self.group = inner, group

    def reply_many(self, transcripts):
        return on_group_leader(lambda: self.inner.reply_many(transcripts), self.group)


class SimulatorRL(RLLoop):
    headline = ("reward_mean", "pg_loss", "lr")

    def __init__(self, config: SimulatorRLConfig):
        from megatron_mimesis.rl.chat import ChatRenderer
        from megatron_mimesis.rl.rewards import rewards_for
        from megatron_mimesis.rl.simulator.episodes import EpisodeRunner
        from megatron_mimesis.rl.simulator.prompts import DomainSampler, load_prompts
        from megatron_mimesis.rl.types import SamplingParams

        super().__init__(config)
        c = config
        self.prompts = load_prompts(c.prompts)
        unknown = sorted({p.domain for p in self.prompts} - set(c.domain_rewards))
        if unknown:
            raise ConfigError(f"domain_rewards: no reward for prompt domain(s) {unknown}")
        self.sampler = DomainSampler(self.prompts, c.domain_weights, c.seed)
        self.rewards = rewards_for(c.domain_rewards, c.reward_options)
        self.runner = EpisodeRunner(
            self.engine, ChatRenderer(self.tokenizer, thinking=c.thinking),
            _LeaderCounterpart(self._counterpart(), self.rollout_group),
            SamplingParams(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p),
            max_turns=c.max_turns,
        )

    def _counterpart(self):
        from megatron_mimesis.rl.simulator.counterparts import OpenAICounterpart, ScriptedCounterpart

        options = self.config.counterpart_options
        if self.config.counterpart == "scripted":
            return ScriptedCounterpart(lambda transcript, reply=options["reply"]: reply)
        return OpenAICounterpart(**options)

    # ------------------------------------------------------------------ one step
    def _score(self, episodes, prompts_by_id) -> Counter:
        """Rewards per domain in one batch each; a failed score leaves the rollout unscored (reward None).
        Returns the ``id`` of every episode whose scoring failed (the reasons are in its ``reward_info``)."""
        failures = set()
        by_domain = defaultdict(list)
        for e in episodes:
            if not e.finished.startswith("error"):
                by_domain[e.domain].append(e)
        for domain, group in by_domain.items():
            prompts = [prompts_by_id[e.prompt_id] for e in group]
            results = on_group_leader(lambda g=group, p=prompts, d=domain: self.rewards[d].score_batch(g, p),
                                       self.rollout_group)
            for e, r in zip(group, results, strict=True):
                e.reward, e.reward_info = r.value, {**r.info, **({"error": r.error} if r.value is None else {})}
                if r.value is None:
                    failures.add(id(e))
        return failures

    def generate(self, step: int, checks) -> tuple:
        """This data-parallel rank's episodes for the step (ids made unique across ranks), scored; the ids of those
        whose scoring failed; the seconds taken. ``checks``: the loop's stop points (``RLLoop`` or the rollout
        worker's)."""
        c = self.config
        start = time.perf_counter()
        mine, offset = self.my_share(self.sampler.sample(c.prompts_per_step))
        self.engine.wake()
        try:
            episodes = self.runner.run(mine, c.rollouts_per_prompt, step_seed=self.step_seed(step),
                                       stop_requested=checks.rollouts_must_stop)
        finally:
            self.engine.sleep()
        for e in episodes:
            e.group_id += offset
            e.rollout_id += offset * c.rollouts_per_prompt
        checks.stop_point("rollouts")
        reward_failures = self._score(episodes, {p.id: p for p in mine})
        rollout_time = time.perf_counter() - start
        checks.stop_point("scoring")
        return episodes, reward_failures, rollout_time

    def train(self, step: int, rollouts: tuple) -> dict:
        from megatron_mimesis.rl.simulator.episodes import fold_rows

        episodes, reward_failures, rollout_time = rollouts
        spread = self.replica_spread(rollout_time)
        rows, staleness = self.on_policy_rows(fold_rows(episodes)[0], step)
        self.stop_point("old log-probs")
        record, summaries = self.gather_and_update(rows, [_summary(e, reward_failures) for e in episodes],
                                                   self.loss_config())
        record.update(_rollout_metrics(summaries))
        record.update(spread)
        record.update(staleness)
        record["rollout_time_s"] = rollout_time
        # sampled tokens per second of one model replica (the data-parallel ranks sample side by side)
        record["rollout_tokens_per_s"] = sum(s["response_tokens"] for s in summaries) / self.dp_size / rollout_time
        return record


def _summary(episode, reward_failures) -> dict:
    return {"group_id": episode.group_id, "rollout_id": episode.rollout_id, "domain": episode.domain,
            "reward": episode.reward, "finished": episode.finished.split(":")[0], "turns": len(episode.turns),
            "response_tokens": sum(len(t.response_ids) for t in episode.turns),
            "reward_failed": id(episode) in reward_failures}


def _rollout_metrics(summaries) -> dict:
    scored = [s for s in summaries if s["reward"] is not None]
    record = {
        "rollouts": len(summaries), "scored_rollouts": len(scored),
        "reward_failures": sum(s["reward_failed"] for s in summaries),
        "unscored_episodes": len(summaries) - len(scored),
        "reward_mean": mean([s["reward"] for s in scored]),
        "reward_std": std([s["reward"] for s in scored]),
        "turns_mean": mean([s["turns"] for s in summaries]),
        "response_tokens_per_turn": mean([s["response_tokens"] / max(s["turns"], 1) for s in summaries]),
    }
    for domain in sorted({s["domain"] for s in scored}):
        record[f"reward/{domain}"] = mean([s["reward"] for s in scored if s["domain"] == domain])
        record[f"reward_std/{domain}"] = std([s["reward"] for s in scored if s["domain"] == domain])
    for reason, count in Counter(s["finished"] for s in summaries).items():
        record[f"finished/{reason}"] = count
    return record


def main(argv: list[str] | None = None) -> int:
    return rl_main(argv, SimulatorRLConfig, SimulatorRL, prog="python -m megatron_mimesis.rl.simulator_rl",
                   description="Simulator RL (FoldGRPO) of a user simulator on megatron-core.")


if __name__ == "__main__":
    sys.exit(main())

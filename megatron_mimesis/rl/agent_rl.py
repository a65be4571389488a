"""Agent RL with GRPO + CSD against the frozen user simulator: the whole loop, top to bottom.

    python -m megatron_mimesis.rl.agent_rl --config FILE [--flag value ...] [--dry-run]   (under torchrun)

Each step: take the next tasks of the environment's train split (seeded epochs); every data-parallel rank
plays its share ``rollouts_per_prompt`` times (the GRPO group), the policy as the agent with the env's tools,
the frozen simulator as the user (its thinking private); score each episode with the env (tau2's own
evaluator, or the toy env's per-turn reward); turn every agent generation into a training row whose reward is
the reward-to-go G_t (gamma); then CSD: a coach writes a note per agent turn from the user's next thinking and
reply, and the current weights, without grad and with the note in context, re-score the student's sampled
tokens (``agent/csd.py``); finally one optimizer step on L_GRPO + alpha L_CSD with advantages over unique rollouts
(each group's statistics read G_0 of every rollout once).

Coach failures drop that turn's CSD term (counted); env scoring failures leave the rollout unscored
(counted, out of the group statistics). Sampled notes, thoughts and teacher contexts go to
``{log_dir}/csd_samples.jsonl`` for inspection.
"""

import json
import sys
import time
from collections import Counter
from pathlib import Path

from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.rl.agent.tasks import TaskSampler
from megatron_mimesis.rl.envs import build_suite
from megatron_mimesis.rl.envs.base import owns_user
from megatron_mimesis.rl.loop import RLLoop, mean, on_group_leader, rl_main, std


class _LeaderUserModel:
    def __init__(self, inner, group):
        self.inner, self.group = inner, group

    def reply_many(self, instructions, transcripts, seed=None):
        return on_group_leader(lambda: self.inner.reply_many(instructions, transcripts, seed), self.group)


class AgentRL(RLLoop):
    headline = ("reward_mean", "pg_loss", "csd_gate_mean")

    def __init__(self, config: AgentRLConfig):
        from megatron_mimesis.rl.agent.agent_chat import agent_chat
        from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner
        from megatron_mimesis.rl.types import SamplingParams

        super().__init__(config)
        c = config
        self.suite = build_suite(c.env, c.env_options)
        self.sampler = TaskSampler(self.suite.mixture(c.train_split), c.seed)
        self.chat = agent_chat(c.preset.family.chat, self.tokenizer, thinking=c.thinking)
        self.sampling = SamplingParams(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p)
        if owns_user(self.suite):  # its gyms call the served simulator themselves, from the group's first rank
            self.suite.connect(**c.user_model_options)
        user_model = None if owns_user(self.suite) else self._user_model()
        self.runner = AgentEpisodeRunner(self.engine, self.chat, user_model, self.sampling, c.max_agent_turns,
                                         on_leader=lambda fn: on_group_leader(fn, self.rollout_group))
        self.coach = self._coach() if c.csd_alpha else None
        self.coach_template = None
        if self.coach is not None:
            from megatron_mimesis.rl.agent.csd import COACH_TEMPLATE

            self.coach_template = COACH_TEMPLATE.read_text()
        self.samples_path = Path(c.log_dir) / "csd_samples.jsonl"

    def _user_model(self):
        """Remote or scripted users answer on the model-parallel leader; a local one is a collective engine."""
        from megatron_mimesis.rl.agent.user_models import EngineUserModel, OpenAIUserModel
        from megatron_mimesis.rl.chat import ChatRenderer
        from megatron_mimesis.rl.engines.local import LocalEngine
        from megatron_mimesis.rl.types import SamplingParams

        c = self.config
        if c.user_model == "scripted":
            from megatron_mimesis.rl.envs.toy import toy_user

            return _LeaderUserModel(toy_user(), self.rollout_group)
        if c.user_model == "openai":
            return _LeaderUserModel(OpenAIUserModel(**c.user_model_options), self.rollout_group)
        options = c.user_model_options
        engine = LocalEngine(self.frozen_copy(options["load"]), self.tokenizer, self.device)
        sampling = SamplingParams(max_new_tokens=options.get("max_new_tokens", 512),
                                  temperature=options.get("temperature", 1.0))
        return EngineUserModel(engine, ChatRenderer(self.tokenizer, thinking=options.get("thinking", True)), sampling)

    def _advantages(self):
        """The update's advantages: FoldGRPO's (None, the loop's default), or UserRL's turn credits."""
        if self.config.advantage == "foldgrpo":
            return None
        from megatron_mimesis.kernels import turn_credit_advantages

        return lambda rows: turn_credit_advantages(rows.rewards.float(), rows.group_ids, rows.rollout_ids,
                                                   rows.response_lengths)

    def _coach(self):
        from megatron_mimesis.rl.agent.csd import EngineCoach, OpenAICoach, ScriptedCoach

        c = self.config
        if c.coach == "scripted":
            return ScriptedCoach(lambda prompt, note=c.coach_options["note"]: note)
        if c.coach == "policy":
            from dataclasses import replace

            return EngineCoach(self.engine, self.chat, replace(self.sampling, max_new_tokens=c.coach_max_new_tokens))
        return OpenAICoach(**c.coach_options)

    # ------------------------------------------------------------------ one step
    def _score(self, episodes) -> Counter:
        """Env scores on the model-parallel leader (an evaluator may call a model), shared with the group."""
        from megatron_mimesis.rl.agent.episodes import score_episodes

        def score():
            failures = score_episodes(episodes)
            return failures, [(e.turn_rewards, e.score_info) for e in episodes]

        failures, results = on_group_leader(score, self.rollout_group)
        for e, (rewards, info) in zip(episodes, results, strict=True):
            e.turn_rewards, e.score_info = rewards, info
        return Counter(failures)

    def _teacher(self, rows, step: int) -> tuple[list[list[float]], dict]:
        """Teacher log-probs per row (``NO_GATE`` where the coach gave no note) and the CSD counters."""
        from megatron_mimesis.rl.agent.csd import (
            NO_GATE,
            check_coach_failures,
            coach_prompt,
            placebo_corrected,
            teacher_context,
        )
        from megatron_mimesis.rl.update.scoring import score_rows

        c = self.config
        prompts = [coach_prompt(self.chat, episode, t, self.coach_template) for _, episode, t in rows]
        if c.coach == "policy":  # the engine is collective over the model-parallel group: every rank generates
            self.engine.wake()
            notes = self.coach.notes_many(prompts)
            self.engine.sleep()
        else:
            notes = on_group_leader(lambda: self.coach.notes_many(prompts), self.mp_group)
        check_coach_failures(notes, c.max_coach_failure_fraction, step + 1)  # step: the iterations done before it
        coached = [k for k, n in enumerate(notes) if n.note is not None]
        contexts = {k: teacher_context(self.chat, rows[k][1], rows[k][2], notes[k].note) for k in coached}
        scored = score_rows(self.trainer.model, [(contexts[k], rows[k][0].response_ids) for k in coached],
                            c.max_tokens_per_microbatch, self.device)
        if c.csd_placebo and coached:
            placebo = score_rows(self.trainer.model, [
                (teacher_context(self.chat, rows[k][1], rows[k][2], c.placebo_note), rows[k][0].response_ids)
                for k in coached], c.max_tokens_per_microbatch, self.device)
            scored = [placebo_corrected(t_row, p_row, rows[k][0].response_logprobs)
                      for k, t_row, p_row in zip(coached, scored, placebo, strict=True)]
        teacher = [[NO_GATE] * len(row.response_ids) for row, _, _ in rows]
        for k, logprobs in zip(coached, scored, strict=True):
            teacher[k] = logprobs
        self._log_samples(step, rows, notes, contexts, teacher)
        return teacher, {"csd_turns": len(coached), "coach_failures": len(notes) - len(coached)}

    def _log_samples(self, step, rows, notes, contexts, teacher) -> None:
        """A few coached turns per step, in full, on the first data-parallel rank's model-parallel leader."""
        if not self.trainer.is_logger or not self.config.csd_log_samples:
            return
        self.samples_path.parent.mkdir(parents=True, exist_ok=True)
        with self.samples_path.open("a") as out:
            for k in sorted(contexts)[:self.config.csd_log_samples]:
                row, episode, t = rows[k]
                thinking, reply = episode.user_reaction(episode.turns[t])
                out.write(json.dumps({
                    "step": step, "task": episode.task.task_id, "rollout": row.rollout_id, "turn": t,
                    "agent_message": episode.messages[episode.turns[t].message_index]["content"],
                    "user_thinking": thinking, "user_reply": reply, "note": notes[k].note,
                    "teacher_context": self.tokenizer.decode(contexts[k][-2000:]),
                    "teacher_minus_student": mean([a - b for a, b in zip(teacher[k], row.response_logprobs, strict=True)]),
                }) + "\n")

    def generate(self, step: int, checks) -> tuple:
        """This data-parallel rank's episodes for the step (ids made unique across ranks), scored; the env's
        scoring failures; the seconds taken. ``checks``: the loop's stop points (``RLLoop`` or the rollout
        worker's)."""
        c = self.config
        start = time.perf_counter()
        mine, offset = self.my_share(self.sampler.sample(c.tasks_per_step))
        self.engine.wake()
        try:
            episodes = self.runner.run(self.suite, mine, c.rollouts_per_prompt,
                                       step_seed=self.step_seed(step),
                                       stop_requested=checks.rollouts_must_stop)
        finally:
            self.engine.sleep()
        checks.stop_point("rollouts")
        for e in episodes:
            e.group_id += offset
            e.rollout_id += offset * c.rollouts_per_prompt
        score_failures = self._score(episodes)
        rollout_time = time.perf_counter() - start
        checks.stop_point("scoring")
        return episodes, score_failures, rollout_time

    def train(self, step: int, rollouts: tuple) -> dict:
        from megatron_mimesis.rl.agent.csd import gate_statistics
        from megatron_mimesis.rl.agent.episodes import agent_rows

        c = self.config
        episodes, score_failures, rollout_time = rollouts
        record = {"rollout_time_s": rollout_time, **self.replica_spread(rollout_time),
                  "score_failures": sum(score_failures.values()),
                  **{f"score_failures/{reason}": n for reason, n in score_failures.items()}}
        rows = agent_rows(episodes, c.gamma, self.suite.name)
        on_policy, staleness = self.on_policy_rows([row for row, _, _ in rows], step)
        record.update(staleness)
        rows = [(row, episode, t) for row, (_, episode, t) in zip(on_policy, rows, strict=True)]
        self.stop_point("old log-probs")
        teacher = None
        if self.coach is not None:
            start = time.perf_counter()
            teacher, csd_counts = self._teacher(rows, step)
            record.update(csd_counts)
            record["teacher_time_s"] = time.perf_counter() - start
            self.stop_point("teacher")
        update, summaries = self.gather_and_update(
            [row for row, _, _ in rows], [_summary(e, self.suite) for e in episodes],
            self.loss_config(csd_alpha=c.csd_alpha, csd_beta=c.csd_beta), teacher, self._advantages())
        record.update(update)
        record.update(_rollout_metrics(summaries, self.suite.name))
        # sampled tokens per second of one model replica (the data-parallel ranks sample side by side)
        record["rollout_tokens_per_s"] = sum(s["response_tokens"] for s in summaries) / self.dp_size / rollout_time
        if teacher is not None:
            record.update(gate_statistics(teacher, [row.response_logprobs for row, _, _ in rows], c.csd_beta))
        return record


def _summary(episode, suite) -> dict:
    scored = episode.turn_rewards is not None
    return {"group_id": episode.group_id, "rollout_id": episode.rollout_id,
            "reward": sum(episode.turn_rewards) if scored else None,
            "domain": suite.domain_of(episode.task.task_id), "success": episode.score_info.get("success"),
            "user_requests": episode.score_info.get("user_requests"),
            "termination": episode.termination.split(":")[0], "turns": len(episode.turns),
            "tool_calls": sum(len(m.get("tool_calls", [])) for m in episode.messages),
            "unparsed_tool_calls": episode.unparsed_tool_calls,
            "response_tokens": sum(len(t.response_ids) for t in episode.turns)}


def _rollout_metrics(summaries, suite_name: str) -> dict:
    """The step's rollouts; a suite of several domains (a mixture of gyms) also each domain's, by name."""
    record = _domain_metrics(summaries)
    for reason, count in Counter(s["termination"] for s in summaries).items():
        record[f"termination/{reason}"] = count
    requests = [s["user_requests"] for s in summaries if s["user_requests"] is not None]
    if requests:
        record["user_requests"] = sum(requests)
    for domain in sorted({s["domain"] for s in summaries} - {suite_name}):
        for name, value in _domain_metrics([s for s in summaries if s["domain"] == domain]).items():
            if name in DOMAIN_METRICS:
                record[f"{domain}/{name}"] = value
    return record


DOMAIN_METRICS = ("rollouts", "reward_mean", "success_rate", "turns_mean", "errors")


def _domain_metrics(summaries) -> dict:
    scored = [s for s in summaries if s["reward"] is not None]
    successes = [s["success"] for s in scored if s["success"] is not None]
    record = {
        "rollouts": len(summaries), "scored_rollouts": len(scored),
        "reward_mean": mean([s["reward"] for s in scored]), "reward_std": std([s["reward"] for s in scored]),
        "turns_mean": mean([s["turns"] for s in summaries]),
        "tool_calls_mean": mean([s["tool_calls"] for s in summaries]),
        "unparsed_tool_calls": sum(s["unparsed_tool_calls"] for s in summaries),
        "response_tokens_per_turn": mean([s["response_tokens"] / max(s["turns"], 1) for s in summaries]),
        "errors": sum(s["termination"] == "error" for s in summaries),
    }
    if successes:
        record["success_rate"] = mean([float(x) for x in successes])
    return record


def main(argv: list[str] | None = None) -> int:
    return rl_main(argv, AgentRLConfig, AgentRL, prog="python -m megatron_mimesis.rl.agent_rl",
                   description="Agent RL (GRPO + CSD) against a frozen user simulator on megatron-core.")


if __name__ == "__main__":
    sys.exit(main())

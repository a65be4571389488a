"""Simulator rollouts: the policy plays the user against a counterpart, turn by turn, for a batch of prompts.

Each turn makes one ``engine.generate`` call for every active episode and then one ``counterpart.reply_many``
call for those still talking. The policy's context for a turn is its task prompt as the system message, the
public transcript (never earlier thinking) and the user generation header; its thinking stays in the episode's
``PolicyTurn`` and only the utterance joins the transcript. Transcripts are the only thing counterparts receive,
and ``check_public`` guards them on the way out.

An episode ends when the simulator writes the end marker (``data_prep.render.END_MARKER``, as mid-training
taught it), after ``max_turns`` policy turns, when the counterpart says it is done, or with ``finished = "error:
..."`` (an empty utterance, a counterpart failure) for the caller to count. ``fold_rows`` turns scored episodes into FoldGRPO rows: one row per policy turn, each with its own
context, sharing the rollout's ids and reward.
"""

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from data_prep.render import END_MARKER
from megatron_mimesis.rl.chat import ChatRenderer, check_public
from megatron_mimesis.rl.engines.protocol import RolloutEngine
from megatron_mimesis.rl.simulator.counterparts import Counterpart
from megatron_mimesis.rl.types import Episode, Generation, PolicyTurn, SamplingParams, TrainingRow


class PromptLike(Protocol):
    """A simulator task (``prompts.PromptRecord`` is one)."""

    id: str
    domain: str
    prompt: str  # the simulator's task, its system prompt by default
    opening: str | None  # the assistant's first message, when the assistant opens the conversation


def task_prompt(prompt: PromptLike) -> str:
    return prompt.prompt


class EpisodeRunner:
    def __init__(
        self,
        engine: RolloutEngine,
        renderer: ChatRenderer,
        counterpart: Counterpart,
        sampling: SamplingParams,
        max_turns: int,
        policy_system_prompt_fn: Callable[[PromptLike], str] = task_prompt,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.engine = engine
        self.renderer = renderer
        self.counterpart = counterpart
        self.sampling = replace(sampling, stop_token_ids=renderer.stop_token_ids)
        self.max_turns = max_turns
        self.policy_system_prompt_fn = policy_system_prompt_fn

    def run(self, prompts: list[PromptLike], rollouts_per_prompt: int, step_seed: int,
            stop_requested: Callable[[], bool] = lambda: False) -> list[Episode]:
        """``rollouts_per_prompt`` episodes per prompt; group_id is the prompt's index, rollout_id a running index.
        ``stop_requested`` is asked after each turn's generation batch (a preemption: the step will be dropped) and
        ends the episodes there when it says so.

        Turn ``t`` of step ``step_seed`` samples with seed ``step_seed * max_turns + t``: reproducible, and for
        non-negative step seeds never the same seed twice in a run or across steps."""
        episodes = []
        system_prompts = []
        for group_id, prompt in enumerate(prompts):
            for _ in range(rollouts_per_prompt):
                episode = Episode(prompt.id, prompt.domain, group_id, rollout_id=len(episodes))
                if prompt.opening:
                    episode.transcript.append({"role": "assistant", "content": prompt.opening})
                episodes.append(episode)
                system_prompts.append(self.policy_system_prompt_fn(prompt))

        active = list(range(len(episodes)))
        for turn in range(self.max_turns):
            if not active:
                break
            contexts = [
                self.renderer.user_prompt([{"role": "system", "content": system_prompts[i]}, *episodes[i].transcript])
                for i in active
            ]
            sampling = replace(self.sampling, seed=step_seed * self.max_turns + turn)
            generations = self.engine.generate(contexts, sampling)
            if len(generations) != len(active):
                raise RuntimeError(f"engine returned {len(generations)} generations for {len(active)} prompts")
            if stop_requested():
                break
            talking = []
            for i, context, generation in zip(active, contexts, generations, strict=True):
                if self._policy_turn(episodes[i], context, generation, last=turn == self.max_turns - 1):
                    talking.append(i)
            active = self._counterpart_turn(episodes, talking)
        return episodes

    def _policy_turn(self, episode: Episode, context: list[int], generation: Generation, last: bool) -> bool:
        """Record the policy's turn; return whether the conversation goes on to the counterpart."""
        thinking, utterance = self.renderer.split_thinking(generation.text)
        stopped = END_MARKER in utterance
        if stopped:
            utterance = utterance.replace(END_MARKER, "").strip()
        episode.turns.append(
            PolicyTurn(
                context_ids=context,
                response_ids=list(generation.token_ids),
                response_logprobs=list(generation.logprobs),
                thinking=thinking,
                utterance=utterance,
                finish_reason=generation.finish_reason,
                policy_version=generation.policy_version,
            )
        )
        if utterance:
            episode.transcript.append({"role": "user", "content": utterance})
        if stopped:
            episode.finished = "stop_marker"
        elif not utterance:
            episode.finished = f"error: empty utterance (finish_reason {generation.finish_reason})"
        elif last:
            episode.finished = "max_turns"
        return not episode.finished

    def _counterpart_turn(self, episodes: list[Episode], talking: list[int]) -> list[int]:
        """Ask the counterpart to answer every episode in ``talking``; return the ones that go on."""
        if not talking:
            return []
        transcripts = [[dict(message) for message in episodes[i].transcript] for i in talking]
        for transcript in transcripts:
            check_public(transcript)
        replies = self.counterpart.reply_many(transcripts)
        if len(replies) != len(talking):
            raise RuntimeError(f"counterpart returned {len(replies)} replies for {len(talking)} transcripts")
        going_on = []
        for i, reply in zip(talking, replies, strict=True):
            episode = episodes[i]
            if reply.error is not None:
                episode.finished = f"error: counterpart: {reply.error}"
                continue
            if reply.text:
                episode.transcript.append({"role": "assistant", "content": reply.text})
            if reply.done:
                episode.finished = "counterpart_done"
            elif not reply.text:
                episode.finished = "error: counterpart: empty reply"
            else:
                going_on.append(i)
        return going_on


def fold_rows(episodes: list[Episode]) -> tuple[list[TrainingRow], dict[str, int]]:
    """One training row per policy turn of every scored episode; unscored episodes are skipped and counted."""
    rows = []
    unscored = 0
    for episode in episodes:
        if episode.reward is None:
            unscored += 1
            continue
        for turn in episode.turns:
            rows.append(
                TrainingRow(
                    group_id=episode.group_id,
                    rollout_id=episode.rollout_id,
                    context_ids=turn.context_ids,
                    response_ids=turn.response_ids,
                    response_logprobs=turn.response_logprobs,
                    reward=episode.reward,
                    domain=episode.domain,
                    policy_version=turn.policy_version,
                )
            )
    return rows, {"episodes": len(episodes), "rows": len(rows), "unscored_episodes": unscored}

"""Agent rollouts: the policy plays the agent in an environment task against the frozen user simulator.

Each round makes one batched ``user_model.reply_many`` call for the episodes waiting on the user and one
batched ``engine.generate`` call for those waiting on the agent. The user always speaks first (after the
agent's opening greeting, when the task has one). An agent generation is one assistant message: its public
text goes to the user, its tool calls are run by the episode's env and the results come back to the agent,
which then moves again; a message without tool calls hands the turn to the user. The episode ends when the
user writes its stop marker ("user_stop"), after ``max_agent_turns`` agent generations ("max_turns"), or
when the user model or an endpoint agent fails ("error: ...", not scored and counted by the caller).

An env that owns its user (``envs.base.UserOwningEnv``, UserRL's gyms) opens the conversation itself and answers
every tool call with a step of its own; there is no user model. The episode then also ends when the env says so
("env_done"), when the agent writes a message without acting on the env ("agent_stop"), or when that message was cut
at the token limit instead ("truncated": not the agent's choice), and a step the env's user could not answer ends it
as "error: user model: ...". Those envs' calls are made through ``on_leader`` (the
model-parallel group's first rank makes them, the others get its answers: the simulator must answer once per
episode, not once per rank), one batch per round, ``suite.concurrency`` episodes at a time; the steps of one
episode run in order and stop at the first that ends it.

The agent's contexts are written, and its generations read, in its family's chat format (``agent_chat.py``); each
generation's row is exactly the ids the engine got and the ids it generated.

Privileged information has one way in. The user's thinking is stored beside the transcript (``user_thinking``),
never in a message; the agent's own thinking likewise (``agent_thinking``), shown back to the agent only where its
format does; the coach's notes (``csd.py``) exist only after rollouts; and every agent context is checked on the way
into the engine (``agent_chat.check_agent_context``): no think markers from the user, no coach-note header. A
violation is a hard error, since a leak would silently train on privileged text.
"""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from megatron_mimesis.kernels import discounted_returns
from megatron_mimesis.rl.agent.user_models import UserModel
from megatron_mimesis.rl.engines.protocol import RolloutEngine
from megatron_mimesis.rl.envs.base import AgentEnv, EnvStep, EnvSuite, EnvTask, owns_user
from megatron_mimesis.rl.types import SamplingParams, TrainingRow

EPISODE_SEEDS = 1 << 20  # rollouts of one rank and step stay below it: their episodes' seeds never meet


@dataclass
class AgentTurn:
    message_index: int  # the assistant message this generation became, in ``AgentEpisode.messages``
    context_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    policy_version: int | None = None  # the generation's


@dataclass
class AgentEpisode:
    task: EnvTask
    env: AgentEnv
    group_id: int
    rollout_id: int
    messages: list[dict] = field(default_factory=list)  # the full record (env.score reads it), no system prompt
    user_thinking: dict[int, str | None] = field(default_factory=dict)  # user message index -> private thinking
    agent_thinking: dict[int, str | None] = field(default_factory=dict)  # assistant message index -> its thinking
    unparsed_tool_calls: int = 0  # <tool_call> blocks of the agent's that did not parse as calls
    turns: list[AgentTurn] = field(default_factory=list)
    termination: str = ""
    turn_rewards: list[float] | None = None  # one per agent turn once scored; None when unscored
    score_info: dict = field(default_factory=dict)
    failure: str | None = None  # once scored: why it is left out of the scores (None: scored)

    def user_reaction(self, turn: AgentTurn) -> tuple[str | None, str | None]:
        """The user's next (thinking, utterance) after ``turn`` (None, None when the episode ended first); for an env
        that owns its user, the env's answer to the turn's first call is that reaction."""
        reacts = ("user", "tool") if owns_user(self.env) else ("user",)
        for index in range(turn.message_index + 1, len(self.messages)):
            if self.messages[index]["role"] in reacts:
                return self.user_thinking.get(index), self.messages[index]["content"]
        return None, None


def user_view(messages: list[dict]) -> list[dict]:
    """What the user sees: its own utterances and the agent's public text, never tool traffic."""
    return [{"role": m["role"], "content": m["content"]} for m in messages
            if m["role"] == "user" or (m["role"] == "assistant" and m["content"])]


def _run_here(fn):
    return fn()


class AgentEpisodeRunner:
    def __init__(self, engine: RolloutEngine, chat, user_model: UserModel | None, sampling: SamplingParams,
                 max_agent_turns: int, on_leader: Callable = _run_here):
        """``chat``: the agent's chat format (``agent_chat.agent_chat``); ``user_model``: None when the suite's envs
        own their user; ``on_leader(fn)`` runs ``fn`` where a user-owning env's calls are made and returns its result
        to every caller (agent RL: the model-parallel group's first rank)."""
        if max_agent_turns < 1:
            raise ValueError(f"max_agent_turns must be at least 1, got {max_agent_turns}")
        self.engine = engine
        self.chat = chat
        self.user_model = user_model
        self.sampling = replace(sampling, stop_token_ids=chat.stop_token_ids)
        self.max_agent_turns = max_agent_turns
        self.on_leader = on_leader
        self.concurrency = 1

    def run(self, suite: EnvSuite, task_ids: list[str], rollouts_per_task: int, step_seed: int,
            stop_requested: Callable[[], bool] = lambda: False) -> list[AgentEpisode]:
        """``rollouts_per_task`` episodes per task; group_id is the task's index, rollout_id a running index.
        ``stop_requested`` is asked after each round (a preemption: the step will be dropped) and ends the episodes
        there when it says so.
        Round ``r`` (every live episode's agent generates once per round, so r < max_agent_turns) seeds its user
        call with ``base + 2r`` and its agent call with ``base + 2r + 1``, ``base = step_seed * 2 *
        max_agent_turns``: reproducible, and for non-negative step seeds never the same seed twice in a run. A
        user-owning env's episode seeds its user with ``step_seed * EPISODE_SEEDS + rollout_id``."""
        episodes = []
        for group_id, task_id in enumerate(task_ids):
            for _ in range(rollouts_per_task):
                env = suite.make(task_id)
                episode = AgentEpisode(env.task, env, group_id, rollout_id=len(episodes))
                if env.task.agent_opening:
                    episode.messages.append({"role": "assistant", "content": env.task.agent_opening})
                episodes.append(episode)
        owning = [i for i, e in enumerate(episodes) if owns_user(e.env)]
        if owning:
            self.concurrency = suite.concurrency
        waiting_user = [i for i, e in enumerate(episodes) if not owns_user(e.env)]
        waiting_agent = self._open(episodes, owning, step_seed)
        base = step_seed * 2 * self.max_agent_turns
        rounds = 0
        while waiting_user or waiting_agent:
            waiting_agent += self._user_round([episodes[i] for i in waiting_user], waiting_user, base + 2 * rounds)
            waiting_user = []
            if waiting_agent:
                sampling = replace(self.sampling, seed=base + 2 * rounds + 1)
                waiting_user, waiting_agent = self._agent_round(episodes, waiting_agent, sampling)
            rounds += 1
            if stop_requested():
                break
        return episodes

    def _env_calls(self, calls: list[Callable]) -> list:
        """Each of ``calls`` (an episode's interaction with its user-owning env) made on the leader, ``concurrency``
        at a time, the results in order on every caller."""
        def make_all():
            with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(calls)))) as pool:
                return list(pool.map(lambda call: call(), calls))

        return self.on_leader(make_all) if calls else []

    def _open(self, episodes: list[AgentEpisode], indices: list[int], step_seed: int) -> list[int]:
        """Open the user-owning envs' episodes: their user's first message; return the indices whose agent moves."""
        opened = self._env_calls([lambda e=episodes[i]: e.env.open(step_seed * EPISODE_SEEDS + e.rollout_id)
                                  for i in indices])
        return [i for i, step in zip(indices, opened, strict=True)
                if _heard(episodes[i], step.error, step.user_thinking, step.text, "env_done" if step.done else None)]

    def _user_round(self, episodes: list[AgentEpisode], indices: list[int], seed: int) -> list[int]:
        """Ask the user model to answer; return the indices whose agent moves next."""
        if not episodes:
            return []
        replies = self.user_model.reply_many([e.task.user_instructions for e in episodes],
                                             [user_view(e.messages) for e in episodes], seed=seed)
        if len(replies) != len(episodes):
            raise RuntimeError(f"user model returned {len(replies)} replies for {len(episodes)} episodes")
        return [index for index, episode, reply in zip(indices, episodes, replies, strict=True)
                if _heard(episode, reply.error, reply.thinking, reply.utterance, "user_stop" if reply.done else None)]

    def _agent_round(self, episodes: list[AgentEpisode], indices: list[int], sampling: SamplingParams):
        contexts = [self.chat.context(episodes[i].task, episodes[i].messages, episodes[i].agent_thinking)
                    for i in indices]
        generations = self.engine.generate(contexts, sampling)
        if len(generations) != len(indices):
            raise RuntimeError(f"engine returned {len(generations)} generations for {len(indices)} prompts")
        acted = []  # (index, its calls) of the episodes whose agent moved
        for i, context, generation in zip(indices, contexts, generations, strict=True):
            episode = episodes[i]
            if generation.finish_reason.startswith("error"):  # an endpoint engine that could not answer
                episode.termination = f"error: agent: {generation.finish_reason}"
                continue
            reply = self.chat.read(generation.text, id_prefix=f"{episode.rollout_id}-{len(episode.turns)}")
            calls = reply.calls
            episode.unparsed_tool_calls += reply.unparsed_calls
            episode.turns.append(AgentTurn(len(episode.messages), context, list(generation.token_ids),
                                           list(generation.logprobs), generation.finish_reason,
                                           generation.policy_version))
            episode.agent_thinking[len(episode.messages)] = reply.thinking
            episode.messages.append({"role": "assistant", "content": reply.text,
                                     **({"tool_calls": calls} if calls else {})})
            acted.append((i, calls))
        owning = [(i, calls) for i, calls in acted if owns_user(episodes[i].env) and calls]
        answers = dict(zip([i for i, _ in owning], self._env_calls(
            [lambda env=episodes[i].env, calls=calls: _steps(env, calls) for i, calls in owning]), strict=True))
        to_user, to_agent = [], []
        for i, calls in acted:
            episode = episodes[i]
            ended = None
            if i in answers:
                ended = self._record_steps(episode, calls, answers[i])
            else:
                for call in calls:
                    episode.messages.append({"role": "tool", "content": episode.env.call_tool(call),
                                             "name": call.name, "tool_call_id": call.id})
                if owns_user(episode.env) and not calls:
                    ended = "truncated" if episode.turns[-1].finish_reason == "length" else "agent_stop"
            if ended is not None:
                episode.termination = ended
            elif len(episode.turns) >= self.max_agent_turns:
                episode.termination = "max_turns"
            elif calls:
                to_agent.append(i)
            else:
                to_user.append(i)
        return to_user, to_agent

    @staticmethod
    def _record_steps(episode: AgentEpisode, calls: list, steps: list[EnvStep]) -> str | None:
        """The env's answers as tool messages (its user's thoughts beside them); the termination they caused."""
        for call, step in zip(calls, steps, strict=False):
            if step.error is not None:
                return f"error: user model: {step.error}"
            episode.user_thinking[len(episode.messages)] = step.user_thinking
            episode.messages.append({"role": "tool", "content": step.text, "name": call.name,
                                     "tool_call_id": call.id})
            if step.done:
                return "env_done"
        return None


def _heard(episode: AgentEpisode, error: str | None, thinking: str | None, text: str, ended: str | None) -> bool:
    """The user's turn into the episode (its words, its private thinking beside them) or the end it made: a failure,
    or ``ended``; whether the agent moves next."""
    if error is not None:
        episode.termination = f"error: user model: {error}"
        return False
    if text:
        episode.user_thinking[len(episode.messages)] = thinking
        episode.messages.append({"role": "user", "content": text})
    if ended is not None:
        episode.termination = ended
        return False
    return True


def _steps(env, calls: list) -> list[EnvStep]:
    """One episode's calls of a round, in order, up to the first that ends the episode."""
    out = []
    for call in calls:
        out.append(env.step(call))
        if out[-1].done or out[-1].error is not None:
            break
    return out


def score_episodes(episodes: list[AgentEpisode]) -> dict[str, int]:
    """Score every ended episode with its env; the rewards of the agent's own turns are kept (an opening
    greeting is the env's, not a policy action). Returns failure counts by reason."""
    for episode in episodes:
        if owns_user(episode.env):
            episode.env.close()
        if episode.termination.startswith("error"):  # "error: agent: ..." or "error: user model: ..."
            episode.failure = episode.termination.split(":")[1].strip().replace(" ", "_") + "_error"
            continue
        score = episode.env.score(episode.messages, episode.termination)
        episode.score_info = dict(score.info)
        assistant = [k for k, m in enumerate(episode.messages) if m["role"] == "assistant"]
        if score.error is None and len(score.turn_rewards) != len(assistant):
            score.error = f"{len(score.turn_rewards)} rewards for {len(assistant)} assistant messages"
        if score.error is not None:
            episode.score_info["error"] = score.error
            episode.failure = f"score: {score.error.split(':')[0]}"
            continue
        by_message = dict(zip(assistant, score.turn_rewards, strict=True))
        episode.turn_rewards = [float(by_message[t.message_index]) for t in episode.turns]
    return count_failures(episode.failure for episode in episodes)


def count_failures(failures) -> dict[str, int]:
    """Counts by reason of the episodes (or episode records) left out of the scores."""
    counts: dict[str, int] = {}
    for reason in failures:
        if reason is not None:
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def agent_rows(episodes: list[AgentEpisode], gamma: float, domain: str) -> list[tuple[TrainingRow, AgentEpisode, int]]:
    """One row per agent turn of every scored episode, its reward the reward-to-go
    G_t = r_t + gamma * G_{t+1}; the episode's first row carries G_0, which the group statistics read."""
    scored = [e for e in episodes if e.turn_rewards is not None and e.turns]
    rewards = [r for e in scored for r in e.turn_rewards]
    ids = [e.rollout_id for e in scored for _ in e.turns]
    if not rewards:
        return []
    returns = discounted_returns(torch.tensor(rewards), torch.tensor(ids), gamma, impl="torch").tolist()
    rows = []
    k = 0
    for episode in scored:
        for t, turn in enumerate(episode.turns):
            rows.append((TrainingRow(episode.group_id, episode.rollout_id, turn.context_ids, turn.response_ids,
                                     turn.response_logprobs, returns[k], domain,
                                     policy_version=turn.policy_version), episode, t))
            k += 1
    return rows

"""The interface between agent RL and the task environments it trains on (tau2 domains, UserRL's gyms, the toy
CPU env).

An ``EnvSuite`` lists task ids and makes one ``AgentEnv`` per episode (an env holds that episode's state, e.g.
tau2's database). Two kinds of env:

* **The runner's user** (tau2, toy): the agent RL runner owns the conversation; the env only answers tool calls and,
  once the episode has ended, scores it. The user is the frozen simulator (``rl/agent/user_models.py``), which gets
  ``EnvTask.user_instructions`` as its private scenario.
* **An env that owns its user** (``UserOwningEnv``, UserRL's gyms): the env simulates its user itself, with its own
  prompts, through an OpenAI-compatible endpoint the run provides (the frozen simulator behind
  ``user_proxy.UserProxy``). The runner relays: the env opens the conversation as the user (``open``), each tool
  call of the agent's is one step of the env (``step``), whose observation is the tool's answer, and the env's own
  per-step rewards score the episode. Everything that reaches the simulator goes through the env on the
  model-parallel group's first rank, so these calls are batched (the runner sends each round's steps together).

Messages are plain dicts, the full record of an episode in order:
``{"role": "system" | "user" | "assistant" | "tool", "content": str}``; an assistant message may carry
``"tool_calls": [ToolCall, ...]`` (content is then its public text, possibly empty); a tool message carries
``"name"`` and ``"tool_call_id"``. Every agent generation is exactly one assistant message.
"""

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str


@dataclass(frozen=True)
class EnvTask:
    task_id: str
    agent_system_prompt: str  # the agent's instructions (e.g. a tau2 domain policy)
    tools: list[dict]  # OpenAI function schemas {"name", "description", "parameters"}; [] for none
    user_instructions: str  # the simulated user's private scenario; only the user model ever sees it
    agent_opening: str | None = None  # a first message by the agent (tau2's agents greet first)


@dataclass
class EnvScore:
    """``turn_rewards``: one reward per assistant message of the scored episode, in order (an env that only
    rewards the outcome puts it on the last one). ``error`` set means the episode could not be scored: it is
    excluded from the group statistics and counted, never given a made-up reward."""

    turn_rewards: list[float]
    info: dict = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class EnvStep:
    """What a user-owning env answers: ``text`` is what the agent sees (the opening user message, or a step's
    observation as the tool's answer); ``done`` ends the episode; ``user_thinking`` is what the simulated user thought
    while answering (private: for CSD's coach only); ``error`` set means the user could not answer (an outage, a
    canned failure line of the env): the episode ends unscored and is counted, never rewarded 0."""

    text: str
    done: bool = False
    user_thinking: str | None = None
    error: str | None = None


class AgentEnv(Protocol):
    task: EnvTask

    def call_tool(self, call: ToolCall) -> str:
        """Run one tool call against this episode's state; a failing call returns its error text (the agent
        sees it, as it would in deployment)."""
        ...

    def score(self, messages: list[dict], termination: str) -> EnvScore:
        """Score the finished episode. ``termination``: "user_stop", "max_turns", or "error: ..."."""
        ...


class UserOwningEnv(AgentEnv, Protocol):
    """An env that simulates its user itself; ``owns_user`` is true (envs without the attribute do not), and its
    suite says how many episodes may call the user at once (``concurrency``). Its episodes also end "env_done" (the
    env ended them), "agent_stop" (the agent wrote a message without acting) or "truncated" (that message was cut at
    the token limit)."""

    owns_user: bool

    def open(self, seed: int) -> EnvStep:
        """Start the episode: the user's first message; ``seed`` makes the user's sampling reproducible."""
        ...

    def step(self, call: ToolCall) -> EnvStep:
        """One tool call of the agent's, answered by the env (and its user)."""
        ...

    def close(self) -> None:
        """The episode is over (scored or not): release what it holds beyond its score."""
        ...


def owns_user(env) -> bool:
    return bool(getattr(env, "owns_user", False))


class EnvSuite(Protocol):
    """``trial_score``: how an evaluation scores a task from its trials' episode scores: "mean" over them, or the
    "max" (best of k tries, as the MIMESIS paper scores UserRL's gyms)."""

    name: str
    trial_score: str

    def task_ids(self, split: str) -> list[str]:
        """The task ids of a split ("train" or "test")."""
        ...

    def mixture(self, split: str) -> dict[str, tuple[list[str], float]]:
        """The split by domain (a gym of a mixture; a single-domain suite is one), each with its sampling weight."""
        ...

    def domain_of(self, task_id: str) -> str:
        """The domain a task belongs to: per-domain metrics and scores are keyed by it."""
        ...

    def episode_score(self, domain: str, turn_rewards: list[float]) -> float:
        """An evaluated episode's score from its turns' rewards (their sum, unless a domain scores otherwise)."""
        ...

    def make(self, task_id: str) -> AgentEnv:
        """A fresh env for one episode of the task."""
        ...


class SingleDomain:
    """What a suite of one domain, scored by the sum of its turn rewards and the mean of its trials, answers."""

    trial_score = "mean"

    def mixture(self, split: str) -> dict[str, tuple[list[str], float]]:
        return {self.name: (self.task_ids(split), 1.0)}

    def domain_of(self, task_id: str) -> str:
        return self.name

    def episode_score(self, domain: str, turn_rewards: list[float]) -> float:
        return float(sum(turn_rewards))

"""The interface between agent RL and the task environments it trains on (tau2 domains, the toy CPU env).

An ``EnvSuite`` lists task ids and makes one ``AgentEnv`` per episode (an env holds that episode's state, e.g.
tau2's database). The agent RL runner owns the conversation; the env only answers tool calls and, once the
episode has ended, scores it. The user is never the env's: it is the frozen simulator (``rl/agent/user_models.py``),
which gets ``EnvTask.user_instructions`` as its private scenario.

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


class AgentEnv(Protocol):
    task: EnvTask

    def call_tool(self, call: ToolCall) -> str:
        """Run one tool call against this episode's state; a failing call returns its error text (the agent
        sees it, as it would in deployment)."""
        ...

    def score(self, messages: list[dict], termination: str) -> EnvScore:
        """Score the finished episode. ``termination``: "user_stop", "max_turns", or "error: ..."."""
        ...


class EnvSuite(Protocol):
    name: str

    def task_ids(self, split: str) -> list[str]:
        """The task ids of a split ("train" or "test")."""
        ...

    def make(self, task_id: str) -> AgentEnv:
        """A fresh env for one episode of the task."""
        ...

"""A scripted toy environment with a verifiable per-turn reward, for CPU tests and the embedded agent-RL demo.

The user wants the access code of an item; the agent has a ``lookup`` tool that returns it. Each agent message
earns 1 when it is brief (1 to ``max_words`` words) and 1 more when it gives the user's code, so a tiny model
has a signal from its first step (length varies at random) while tool use and relaying the code pay more. The
scripted user thinks out loud (private: only the coach sees it) about what it still needs, which is exactly the
hindsight a coach's note can turn into a dense teacher signal.
"""

import random
import re

from data_prep.render import END_MARKER
from megatron_mimesis.rl.agent.user_models import ScriptedUserModel
from megatron_mimesis.rl.envs.base import EnvScore, EnvTask, SingleDomain, ToolCall

ITEMS = ("alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "tango")
LOOKUP_TOOL = {
    "name": "lookup",
    "description": "Return the access code of an item.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
}
_ITEM = re.compile(r"code for (\w+)")


def code_of(item: str) -> str:
    return f"{sum(map(ord, item)) % 900 + 100}"


class ToyEnv:
    def __init__(self, task: EnvTask, item: str, max_words: int):
        self.task, self.item, self.max_words = task, item, max_words

    def call_tool(self, call: ToolCall) -> str:
        if call.name != "lookup":
            return f"Error: unknown tool {call.name!r}"
        item = str(call.arguments.get("item", "")).lower()
        return code_of(item) if item in ITEMS else f"Error: no item {item!r}"

    def score(self, messages: list[dict], termination: str) -> EnvScore:
        rewards = []
        for message in messages:
            if message["role"] == "assistant":
                words = len(message["content"].split())
                rewards.append(float(1 <= words <= self.max_words) + float(code_of(self.item) in message["content"]))
        return EnvScore(rewards, {"termination": termination})


class ToySuite(SingleDomain):
    name = "toy"

    def __init__(self, num_tasks: int = 8, max_words: int = 3, seed: int = 0):
        rng = random.Random(seed)
        self.items = [rng.choice(ITEMS) for _ in range(num_tasks)]
        self.max_words = max_words

    def task_ids(self, split: str) -> list[str]:
        if split not in ("train", "test"):
            raise ValueError(f"toy env has splits 'train' and 'test', not {split!r}")
        half = len(self.items) // 2
        indices = range(half, len(self.items)) if split == "test" else range(half)
        return [f"toy-{i}" for i in indices]

    def make(self, task_id: str) -> ToyEnv:
        item = self.items[int(task_id.removeprefix("toy-"))]
        task = EnvTask(task_id, "You are a helpful agent. Answer briefly.", [LOOKUP_TOOL],
                       f"You want the access code for {item}. Ask for it, and stop once you have it.")
        return ToyEnv(task, item, self.max_words)


def toy_user(stop_marker: str = END_MARKER, patience: int = 2) -> ScriptedUserModel:
    """Asks for its item's code, thanks and stops when the agent gives it, stops after ``patience`` tries."""

    def reply(instructions: str, transcript: list[dict]) -> tuple[str, str]:
        item = _ITEM.search(instructions).group(1)
        agent = [m["content"] for m in transcript if m["role"] == "assistant"]
        asked = sum(m["role"] == "user" for m in transcript)
        if agent and code_of(item) in agent[-1]:
            return "I got my code.", f"Thanks! {stop_marker}"
        if asked >= patience:
            return "The agent never gave me the code.", f"Never mind. {stop_marker}"
        if agent:
            return (f"That was not the code for {item}; I need just the number, briefly.",
                    f"Please, what is the code for {item}?")
        return f"I need the code for {item}.", f"Hi, what is the code for {item}?"

    return ScriptedUserModel(reply, stop_marker)

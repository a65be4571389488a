"""UserRL's gyms through the adapter, run by the gyms' own code (installed from ../shared/third_party by make venv):
FunctionGym episodes of a scripted agent and of the tiny model, scored by the gym; TelepathyGym whose user is an
OpenAI-compatible server behind the per-episode proxy (thinking stripped and kept, seeds and request fields added,
every request counted); an outage, with the upstream gone, ending the episode as a counted error with no reward;
the suite's splits, options and refusals. The same gyms against real vLLM are in ``test_userrl_served.py``."""

import json
import socket

import pytest

from megatron_mimesis.rl.agent.agent_chat import PiecewiseAgentChat
from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner, agent_rows, score_episodes
from megatron_mimesis.rl.envs import build_suite
from megatron_mimesis.rl.envs.userrl import TOOL_NAME, UserRLError
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.fakes import FakeOpenAIServer, ScriptedEngine, char_tokenizer

pytest.importorskip("functiongym", reason="UserRL's gyms: make venv installs them from ../shared/third_party")
pytest.importorskip("telepathygym", reason="UserRL's gyms: make venv installs them from ../shared/third_party")


def call(choice: str, content: str) -> str:
    return (f"<tool_call>\n<function={TOOL_NAME}>\n<parameter=choice>\n{choice}\n</parameter>\n"
            f"<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>")


def _runner(texts, max_agent_turns=4):
    tokenizer = char_tokenizer()
    engine = ScriptedEngine(tokenizer, texts)
    return AgentEpisodeRunner(engine, PiecewiseAgentChat(tokenizer, thinking=False), None, SamplingParams(),
                              max_agent_turns), engine, tokenizer


def test_function_gym_episodes_are_played_through_the_tool_and_scored_by_the_gym():
    from functiongym.data_loader import get_function_by_id

    suite = build_suite("userrl", {"gyms": {"FunctionGym": {}}})
    task = get_function_by_id("func-1")  # c * (a * b) * d, test case [3, 5, 5, 3]
    a, b, c, d = 1, 2, 3, 4
    probe = eval(task["rule"], {}, {"a": a, "b": b, "c": c, "d": d})  # noqa: S307 (the data's own rule)
    runner, engine, tokenizer = _runner([
        [call("action", "1 2 3 4"), call("guess", "maybe")],
        [call("search", "test"), call("answer", "7")],
        [call("answer", f"{task['expected_result']:g}"), "I give up."],
    ])
    first, second = runner.run(suite, ["FunctionGym/func-1"], rollouts_per_task=2, step_seed=1)
    assert first.messages[0] == {"role": "user", "content": "I have a function of four numbers in mind. What is its "
                                                            "value on the test case?"}
    tool = [m["content"] for m in first.messages if m["role"] == "tool"]
    assert tool == [f"For numbers [1.0, 2.0, 3.0, 4.0], the result is {float(probe)}.\nReward: 0",
                    f"Test case: {task['test_case']}\nReward: 0", "Your answer is correct!\nReward: 1"]
    assert first.termination == "env_done" and second.termination == "agent_stop"
    # a call the gym cannot take is answered with its error, and costs no step of the gym
    assert [m["content"] for m in second.messages if m["role"] == "tool"][0].startswith(
        f"Error: call {TOOL_NAME} with choice one of ['action', 'search', 'answer', 'finish']")
    assert score_episodes([first, second]) == {}
    assert first.turn_rewards == [0.0, 0.0, 1.0] and second.turn_rewards == [0.0, 0.0, 0.0]
    assert first.score_info["success"] and first.score_info["steps"] == 3 and second.score_info["steps"] == 1
    assert not second.score_info["success"]
    # the agent saw the gym's description and its one tool; every turn is a row with the reward-to-go
    context = tokenizer.decode(engine.calls[0][0][0])
    assert "A hidden function maps four numbers" in context and f'"name": "{TOOL_NAME}"' in context
    assert [row.reward for row, _, _ in agent_rows([first], 0.8, suite.name)] == pytest.approx([0.64, 0.8, 1.0])


def test_a_message_cut_at_the_token_limit_ends_the_episode_as_truncated_not_as_the_agents_stop():
    suite = build_suite("userrl", {"gyms": {"FunctionGym": {}}})
    tokenizer = char_tokenizer()
    engine = ScriptedEngine(tokenizer, [["Let me work out what the numbers"]], finish_reason="length")
    runner = AgentEpisodeRunner(engine, PiecewiseAgentChat(tokenizer, thinking=False), None, SamplingParams(), 4)
    (episode,) = runner.run(suite, ["FunctionGym/func-1"], rollouts_per_task=1, step_seed=0)
    assert episode.termination == "truncated" and [t.finish_reason for t in episode.turns] == ["length"]
    assert score_episodes([episode]) == {} and episode.score_info["termination"] == "truncated"


def test_the_tiny_model_plays_function_gym(tiny_dataset, tiny_hf_checkpoint):
    from transformers import AutoTokenizer

    from megatron_mimesis.rl.engines.hf import HFEngine

    suite = build_suite("userrl", {"gyms": {"FunctionGym": {}}, "max_steps": 3})
    tokenizer = AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")
    engine = HFEngine.from_pretrained(str(tiny_hf_checkpoint), tokenizer=tokenizer, seed=0)
    runner = AgentEpisodeRunner(engine, PiecewiseAgentChat(tokenizer, thinking=False), None,
                                SamplingParams(max_new_tokens=12), max_agent_turns=3)
    episodes = runner.run(suite, suite.task_ids("test")[:2], rollouts_per_task=1, step_seed=0)
    assert score_episodes(episodes) == {}
    for episode in episodes:  # a random model writes no call: its first message ends the episode, scored 0
        assert episode.termination in ("truncated", "agent_stop", "env_done", "max_turns") and len(episode.turns) >= 1
        if episode.termination in ("truncated", "agent_stop"):  # cut at max_new_tokens, or its own end
            assert episode.turns[-1].finish_reason == ("length" if episode.termination == "truncated" else "stop")
        assert episode.turn_rewards == [0.0] * len(episode.turns) and episode.score_info["gym"] == "FunctionGym"


TELEPATHY = {"gyms": {"TelepathyGym": {"request_fields": {"max_tokens": 64}}}, "timeout_s": 5}


def _question_answered(messages):
    """The simulator as TelepathyGym's judge: it thinks, then answers the JSON the gym parses."""
    prompt = messages[-1]["content"]
    if "User's Final Guess" in prompt:
        return '<think>They guessed.</think>{"thought": "no", "judgment": "No", "feedback": "Not quite."}'
    return '<think>It is a physicist, so yes.</think>```json\n{"thought": "t", "response": "Yes"}\n```'


def test_telepathy_gym_calls_its_user_through_the_proxy():
    """The upstream asks for a key (vllm serve --api-key): the gym sends Bearer EMPTY, the proxy the run's key."""
    with FakeOpenAIServer(reply=_question_answered, api_key="sim-key") as upstream:
        suite = build_suite("userrl", TELEPATHY).connect(upstream.base_url, "mimesis-sim", api_key="sim-key")
        runner, engine, tokenizer = _runner([[call("action", "Is it a person?")], [call("answer", "Marie Curie")],
                                             [call("finish", "done")]])
        (episode,) = runner.run(suite, ["TelepathyGym/entity_001"], rollouts_per_task=1, step_seed=2)
        assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [
            "Yes\nReward: 0", "Not quite.\nReward: 0", "Game finished.\nReward: 0"]
        assert episode.termination == "env_done"
        # the gym got the reply without the thinking, which the episode keeps for the coach
        thoughts = [episode.user_thinking[i] for i, m in enumerate(episode.messages) if m["role"] == "tool"]
        assert thoughts == ["It is a physicist, so yes.", "They guessed.", None]
        assert episode.user_reaction(episode.turns[0]) == ("It is a physicist, so yes.", "Yes\nReward: 0")
        # the opening is the gym's own description, never the entity (the gym's observation holds its title)
        assert "Einstein" not in episode.messages[0]["content"] and "thinking of" in episode.messages[0]["content"]
        assert all("Einstein" not in tokenizer.decode(p) for prompts, _ in engine.calls for p in prompts)
        # what the server got: the served name, the gym's fields, a seed per request of the episode
        requests = upstream.requests
        assert len(requests) == 2 and all(r["model"] == "mimesis-sim" and r["max_tokens"] == 64 for r in requests)
        assert all(r["skip_special_tokens"] is False for r in requests)  # the think markers reach the proxy
        assert [r["seed"] for r in requests] == [(2 * (1 << 20)) * 1000, (2 * (1 << 20)) * 1000 + 1]
        assert "Albert Einstein" in requests[0]["messages"][1]["content"]  # the judge knows the target
        assert score_episodes([episode]) == {} and episode.score_info["user_requests"] == 2
        assert suite.user_proxy().statistics()["requests"] == 2 and suite.user_proxy().episodes == {}
        suite.close()


def test_an_outage_ends_the_episode_as_a_counted_error_with_no_reward():
    with socket.socket() as sock:  # a port nobody listens on: the simulator's server is gone
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    suite = build_suite("userrl", TELEPATHY).connect(dead, "mimesis-sim")
    runner, _, _ = _runner([[call("action", "Is it a person?"), call("action", "Is it alive?")]])
    episodes = runner.run(suite, ["TelepathyGym/entity_001"], rollouts_per_task=2, step_seed=0)
    for episode in episodes:  # the gym itself answered "Unable to respond to your question right now.", reward 0
        assert episode.termination.startswith("error: user model: TelepathyGym: ")
        assert "Connection refused" in episode.termination
        assert [m["role"] for m in episode.messages] == ["user", "assistant"]
    assert score_episodes(episodes) == {"user_model_error": 2}
    assert all(e.turn_rewards is None for e in episodes) and agent_rows(episodes, 0.8, "userrl") == []
    stats = suite.user_proxy().statistics()
    assert stats["failures"] == stats["requests"] >= 2  # the gym retries: every attempt is counted
    suite.close()


def test_the_gyms_split_their_tasks_and_refuse_what_they_cannot_run(tmp_path):
    suite = build_suite("userrl", {"gyms": {"FunctionGym": {"weight": 3}, "IntentionGym": {}}})
    mixture = suite.mixture("train")
    assert mixture["FunctionGym"][1] == 3.0 and mixture["IntentionGym"][1] == len(mixture["IntentionGym"][0]) == 1012
    assert len(suite.task_ids("test")) == len(suite.mixture("test")["FunctionGym"][0]) + 95  # IntentionGym's file
    train, test = (set(suite.mixture(s)["FunctionGym"][0]) for s in ("train", "test"))
    assert not train & test and len(train | test) == 538 and 0.15 < len(test) / 538 < 0.25
    assert suite.domain_of("IntentionGym/abc") == "IntentionGym"
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["func-1", "func-2"], "test": ["func-3"]}))
    own = build_suite("userrl", {"gyms": {"FunctionGym": {"split_file": str(split)}}})
    assert own.task_ids("train") == ["FunctionGym/func-1", "FunctionGym/func-2"]
    split.write_text(json.dumps({"train": ["func-999"]}))
    for options, message in (
            ({"gyms": {"FunctionGym": {"split_file": str(split)}}}, "1 ids are not FunctionGym tasks"),
            ({"gyms": {"ChessGym": {}}}, "['ChessGym'] are not gyms of UserRL's"),
            ({"gyms": {"FunctionGym": {"temperature": 0}}}, "['temperature'] are not options of a gym"),
            ({"gyms": {"FunctionGym": {}}, "reward": "test"}, "reward must be one of ('train', 'eval')"),
            ({"gyms": {"TravelGym": {}}}, "TravelGym: its tasks do not load"),
            ({"gyms": {"PersuadeGym": {}}}, "its data files are not part of this copy of the gym")):
        with pytest.raises(UserRLError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            build_suite("userrl", options)


def test_tau_gym_reaches_its_user_by_model_name_and_hears_it_stop():
    """TauGym's user is tau-bench's, through litellm, which reads one process-wide URL: the proxy knows the episode
    by its model name. tau-bench's user asks twice at reset (tau-bench's own reset, then the gym's); a tool call's
    content the call's format read as JSON reaches the gym as JSON text; the simulator's trained <END> is tau-bench's
    ###STOP###, which ends the episode."""
    pytest.importorskip("taugym", reason="UserRL's gyms: make venv installs them from ../shared/third_party")
    from megatron_mimesis.rl.envs.base import ToolCall

    replies = iter(["<think>I want a refund.</think>Hi, I need to return an item."] * 2 + ["Thanks, that is all. <END>"])
    with FakeOpenAIServer(reply=lambda messages: next(replies)) as upstream:
        suite = build_suite("userrl", {"gyms": {"TauGym": {}}}).connect(upstream.base_url, "mimesis-sim")
        env = suite.make("TauGym/retail-train-000")
        opened = env.open(seed=5)
        assert (opened.text, opened.error) == ("User says: Hi, I need to return an item.", None)
        assert opened.user_thinking == "I want a refund.\n\nI want a refund."
        tool = env.step(ToolCall(TOOL_NAME, {"choice": "answer",
                                             "content": {"name": "calculate", "arguments": {"expression": "2 + 2"}}},
                                 "c1"))
        assert (tool.text, tool.done) == ("4.0\nReward: 0", False)
        ended = env.step(ToolCall(TOOL_NAME, {"choice": "action", "content": "Anything else?"}, "c2"))
        assert ended.done and ended.text.startswith("Thanks, that is all. ###STOP###")
        assert [r["model"] for r in upstream.requests] == ["mimesis-sim"] * 3
        assert upstream.requests[-1]["messages"][-1] == {"role": "user", "content": "Anything else?"}
        assert env.score([], "env_done").info["user_requests"] == 3
        suite.close()

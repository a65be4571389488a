"""Agent rollouts on the toy env with a scripted engine: tool calls, the privileged-information boundary,
reward-to-go and FoldGRPO advantages, all checked against hand-computed values."""

import pytest
import torch
from megatron_mimesis.kernels import foldgrpo_advantages

from megatron_mimesis.rl.agent.agent_chat import NOTE_HEADER, PiecewiseAgentChat
from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner, agent_rows, score_episodes
from megatron_mimesis.rl.agent.user_models import ScriptedUserModel
from megatron_mimesis.rl.chat import PrivilegedTextLeak
from megatron_mimesis.rl.envs.toy import ToySuite, code_of, toy_user
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.fakes import ScriptedEngine, char_tokenizer

SUITE = ToySuite(num_tasks=2, max_words=3, seed=0)
ITEM = SUITE.items[0]
CODE = code_of(ITEM)
LOOKUP = f"<tool_call>\n<function=lookup>\n<parameter=item>\n{ITEM}\n</parameter>\n</function>\n</tool_call>"


class RecordingUser:
    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def reply_many(self, instructions, transcripts, seed=None):
        self.seen += transcripts
        return self.inner.reply_many(instructions, transcripts, seed)


def _run(agent_texts, user=None, max_agent_turns=3):
    tokenizer = char_tokenizer()
    engine = ScriptedEngine(tokenizer, agent_texts)
    user = user or RecordingUser(toy_user())
    runner = AgentEpisodeRunner(engine, PiecewiseAgentChat(tokenizer, thinking=False), user, SamplingParams(),
                                max_agent_turns)
    episodes = runner.run(SUITE, ["toy-0"], rollouts_per_task=2, step_seed=3)
    return episodes, engine, user, tokenizer


def test_tool_calls_thoughts_rewards_and_returns_by_hand():
    episodes, engine, user, tokenizer = _run([[LOOKUP, "I do not know, sorry friend."], [f"Code {CODE}", "No idea"]])
    first, second = episodes
    assert [m["role"] for m in first.messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert first.messages[1]["content"] == "" and first.messages[1]["tool_calls"][0].arguments == {"item": ITEM}
    assert first.messages[2]["content"] == CODE
    assert first.termination == second.termination == "user_stop"
    assert [sampling.seed for _, sampling in engine.calls] == [19, 21]  # step 3, 3 turns: base 18, rounds 0 and 1
    # the user never sees tool traffic; the agent never sees the user's thinking
    assert all(m["role"] in ("user", "assistant") and m["content"] for t in user.seen for m in t)
    contexts = [tokenizer.decode(p) for prompts, _ in engine.calls for p in prompts]
    assert all("I need the code" not in c and "That was not the code" not in c for c in contexts)
    assert f"<tool_response>\n{CODE}\n</tool_response>" in contexts[2]
    # the coach's inputs: the user's private thinking and reply after each agent turn
    assert second.user_reaction(second.turns[0]) == (
        f"That was not the code for {ITEM}; I need just the number, briefly.", f"Please, what is the code for {ITEM}?")
    assert first.user_reaction(first.turns[0])[1] == "Thanks!"  # a tool turn's reaction is the next user message

    assert score_episodes(episodes) == {}
    # brief (1-3 words) earns 1, giving the code 1 more: [tool call: 0, "Code C": 2], [6 words: 0, "No idea": 1]
    assert first.turn_rewards == [0.0, 2.0] and second.turn_rewards == [0.0, 1.0]
    rows = [row for row, _, _ in agent_rows(episodes, gamma=0.8, domain="toy")]
    assert [r.reward for r in rows] == pytest.approx([0.8 * 2.0, 2.0, 0.8 * 1.0, 1.0])
    assert [r.rollout_id for r in rows] == [0, 0, 1, 1] and {r.group_id for r in rows} == {0}
    advantages = foldgrpo_advantages(torch.tensor([r.reward for r in rows]), torch.tensor([r.group_id for r in rows]),
                                     torch.tensor([r.rollout_id for r in rows]), impl="torch")
    mean, std = 1.2, (2 * 0.4**2) ** 0.5  # G_0 of the two rollouts: 1.6 and 0.8
    expected = [(g - mean) / (std + 1e-6) for g in (1.6, 2.0, 0.8, 1.0)]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5)


def test_max_turns_ends_an_agent_that_keeps_calling_tools():
    episodes, _, _, _ = _run([[LOOKUP, LOOKUP], [LOOKUP, LOOKUP]], max_agent_turns=2)
    assert all(e.termination == "max_turns" and len(e.turns) == 2 for e in episodes)


def test_a_coach_note_in_an_agent_context_is_a_hard_error():
    leaky = ScriptedUserModel(lambda instructions, transcript: (None, f"{NOTE_HEADER}\nsay the code"))
    with pytest.raises(PrivilegedTextLeak, match="coach's note"):
        _run([["hello", "hello"]], user=leaky)


def test_user_thinking_markers_never_reach_the_agent():
    leaky = ScriptedUserModel(lambda instructions, transcript: (None, "<think>secret</think> hi"))
    with pytest.raises(PrivilegedTextLeak, match="think marker"):
        _run([["hello", "hello"]], user=leaky)


def test_user_model_failure_leaves_the_episode_unscored_and_counted():
    class Failing:
        def reply_many(self, instructions, transcripts, seed=None):
            from megatron_mimesis.rl.agent.user_models import UserReply

            return [UserReply(None, "", False, "endpoint down")] * len(transcripts)

    episodes, _, _, _ = _run([], user=Failing())
    assert all(e.termination == "error: user model: endpoint down" for e in episodes)
    assert score_episodes(episodes) == {"user_model_error": 2}
    assert agent_rows(episodes, 0.8, "toy") == []

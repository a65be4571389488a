"""Verifiable rewards, the registry, and the behaviour formula / strict verdict parsing, each checked by hand."""

import pytest

from megatron_mimesis.rl.rewards import RewardResult, get_reward, rewards_for
from megatron_mimesis.rl.rewards.behaviour import BehaviourReward, behaviour_reward, judge_messages, parse_verdict
from megatron_mimesis.rl.rewards.judge import JudgeReply
from megatron_mimesis.rl.rewards.verifiable import (
    Choice,
    ContainsTarget,
    ExactMatch,
    LengthTarget,
    Numeric,
    extract_last_number,
    normalise,
)
from megatron_mimesis.rl.simulator.prompts import Behavior, PromptRecord
from megatron_mimesis.rl.types import Episode


def episode(*user_turns, assistant="Sure."):
    transcript = []
    for turn in user_turns:
        transcript += [{"role": "assistant", "content": assistant}, {"role": "user", "content": turn}]
    return Episode(prompt_id="p", domain="d", group_id=0, rollout_id=0, transcript=transcript)


def prompt(reference=None, text="task", behavior=None):
    return PromptRecord("p", "d", text, reference=reference, behavior=behavior)


def value(reward, ep, pr):
    result = reward.score(ep, pr)
    assert result.error is None, result.error
    return result.value


def test_normalise():
    assert normalise("  The  ANSWER: Paris!! ") == "the answer paris"


def test_exact_match_grades_the_last_utterance():
    reward = ExactMatch()
    assert value(reward, episode("London", " paris. "), prompt("Paris")) == 1.0
    assert value(reward, episode("Paris", "London"), prompt("Paris")) == 0.0
    assert value(reward, episode("new-york"), prompt(["NYC", "New York"])) == 1.0  # punctuation acts as a space
    assert value(reward, episode("newyork"), prompt(["NYC", "New York"])) == 0.0
    assert value(reward, episode("New York!"), prompt(["NYC", "New York"])) == 1.0
    assert value(reward, episode("42"), prompt(42)) == 1.0


def test_choice():
    reward = Choice()
    listed = prompt("B", text="Which city?\nA) London\nB) Paris\nC) Rome")
    assert value(reward, episode("B"), listed) == 1.0
    assert value(reward, episode("(b)"), listed) == 0.0  # a lowercase bare letter is not an answer
    assert value(reward, episode("I think the answer is (B)."), listed) == 1.0
    assert value(reward, episode("Answer: C"), listed) == 0.0
    assert value(reward, episode("Probably Paris, I'd say."), listed) == 1.0  # listed option text
    assert value(reward, episode("Paris or Rome?"), listed) == 0.0  # two options: no single choice
    assert value(reward, episode("(A) or (B)"), listed) == 0.0  # two letters: no single choice
    by_text = prompt("paris", text="Which city?\nA) London\nB) Paris\nC) Rome")
    assert value(reward, episode("option B"), by_text) == 1.0
    assert reward.score(episode("B"), prompt("Paris", text="no options")).error == (
        "prompt 'p': choice reference 'Paris' is neither a letter A-E nor one listed option"
    )


def test_numeric():
    reward = Numeric()
    assert extract_last_number("from 3 to -1,234.5e1 km") == -12345.0
    assert extract_last_number("no digits") is None
    assert value(reward, episode("It is 10001.5 dollars"), prompt(10000)) == 0.0  # 1.5e-4 relative
    assert value(reward, episode("about 10000.9"), prompt("10000")) == 1.0  # 9e-5 relative
    assert value(reward, episode("0.0000005"), prompt(0)) == 1.0  # within abs 1e-6
    assert value(reward, episode("0.000002"), prompt(0)) == 0.0
    assert value(reward, episode("I got 7 then 12"), prompt(7)) == 0.0  # the last number counts
    assert value(reward, episode("no idea"), prompt(7)) == 0.0
    assert reward.score(episode("7"), prompt("seven")).value is None


def test_contains_target_any_utterance_whole_word():
    reward = ContainsTarget()
    assert value(reward, episode("I want a PIZZA.", "thanks"), prompt("pizza")) == 1.0
    assert value(reward, episode("pizzas please"), prompt("pizza")) == 0.0
    assert value(ContainsTarget(), episode("hi"), prompt("pizza")) == 0.0
    assistant_says_it = [{"role": "assistant", "content": "pizza"}, {"role": "user", "content": "ok"}]
    assert value(reward, Episode("p", "d", 0, 0, transcript=assistant_says_it), prompt("pizza")) == 0.0


def test_length_target():
    reward = LengthTarget()
    assert value(reward, episode("one two three four five"), prompt(5)) == 1.0
    assert value(reward, episode("one two three"), prompt(4)) == 0.75
    assert value(reward, episode("a b c d e f g h i j k l"), prompt(4)) == 0.0  # 1 - 8/4 clipped at 0
    assert reward.score(episode("x"), prompt("four")).error == (
        "prompt 'p': length_target reference must be a positive number, got 'four'"
    )


def test_failures_are_none_with_a_reason():
    assert ExactMatch().score(Episode("p", "d", 0, 0), prompt("x")) == RewardResult(
        None, {}, "no simulator utterance in the transcript"
    )
    assert ExactMatch().score(episode("x"), prompt()) == RewardResult(None, {}, "prompt 'p' has no reference")


def test_score_batch_is_a_loop():
    results = Numeric().score_batch([episode("3"), episode("4")], [prompt(3), prompt(3)])
    assert [r.value for r in results] == [1.0, 0.0]


def test_registry_resolution():
    rewards = rewards_for({"math": "numeric", "gsm": "numeric", "toy": "contains_target"})
    assert isinstance(rewards["math"], Numeric) and rewards["math"] is rewards["gsm"]
    assert get_reward("behaviour").__name__ == "from_config"
    with pytest.raises(ValueError, match=r"unknown reward 'exact'; known rewards: \['behaviour', 'choice', "):
        rewards_for({"math": "exact"})
    with pytest.raises(ValueError, match=r"options given for rewards no domain uses: \['behaviour'\]"):
        rewards_for({"math": "numeric"}, {"behaviour": {"judge": {}}})


def test_behaviour_formula_by_hand():
    assert behaviour_reward(1.0, 0.5, 1.0, 0.0, False) == pytest.approx(0.75)  # (2 + 0.75 + 1 + 0) / 5
    assert behaviour_reward(1.0, 0.5, 1.0, 0.0, True) == pytest.approx(0.375)
    assert behaviour_reward(1.0, 0.5, 0.0, 0.0, False) == pytest.approx(0.55)  # (2 + 0.75) / 5
    assert behaviour_reward(1.0, 0.5, 0.0, 0.0, True) == pytest.approx(0.275)
    assert behaviour_reward(1.0, 1.0, 1.0, 1.0, False) == 1.0
    assert behaviour_reward(0.0, 0.0, 0.0, 1.0, False) == pytest.approx(0.1)


GOOD = '{"e": 1, "p": 0.5, "n": 0.0, "c": 0, "described_instead_of_enacted": false}'  # r = 0.55


def test_parse_verdict_accepts_plain_and_single_fence():
    assert parse_verdict(f"  {GOOD}\n") == {"e": 1, "p": 0.5, "n": 0.0, "c": 0, "described_instead_of_enacted": False}
    assert parse_verdict(f"```json\n{GOOD}\n```")["p"] == 0.5
    assert parse_verdict(f"```\n{GOOD}\n```")["p"] == 0.5


class FakeJudge:
    """Stands in for JudgeClient: fixed replies, records what it was asked."""

    def __init__(self, replies):
        self.replies = replies
        self.asked = []

    def score_many(self, requests):
        self.asked.append(requests)
        return self.replies[: len(requests)]


BEHAVIOR = Behavior("impatience", "gets short with slow answers")
BAD_REPLIES = [
    "The user was quite impatient, I'd give 0.8.",  # prose
    '{"e": 1, "p": 0.5, "n": 1, "described_instead_of_enacted": false}',  # missing key
    '{"e": 1, "p": 1.5, "n": 1, "c": 0, "described_instead_of_enacted": false}',  # out of range
    f"Here is my verdict: {GOOD}",  # extra text around the JSON
    f"```json\n{GOOD}\n```\nHope this helps!",  # text after the fence
    '{"e": 1, "p": 0.5, "n": 1, "c": 0, "described_instead_of_enacted": "no"}',  # flag not a bool
    '{"e": true, "p": 0.5, "n": 1, "c": 0, "described_instead_of_enacted": false}',  # bool is not a number
    '{"e": 1, "p": 0.5, "n": 1, "c": 0, "described_instead_of_enacted": false, "notes": ""}',  # extra key
    "[1, 0.5, 1, 0, false]",  # not an object
]


def test_behaviour_batch_scores_and_counts_parse_failures():
    replies = [JudgeReply(GOOD, None, False), JudgeReply(GOOD.replace("false", "true"), None, True)]
    replies += [JudgeReply(text, None, False) for text in BAD_REPLIES] + [JudgeReply(None, "timeout", False)]
    judge = FakeJudge(replies)
    reward = BehaviourReward(judge)
    n = len(replies)
    results = reward.score_batch([episode("hurry up!")] * n, [prompt(behavior=BEHAVIOR)] * n)

    assert len(judge.asked) == 1 and len(judge.asked[0]) == n  # one score_many call for the batch
    assert results[0].value == pytest.approx(0.55) and results[0].info["judge_cached"] is False
    assert results[1].value == pytest.approx(0.275) and results[1].info["described_instead_of_enacted"] is True
    assert [r.value for r in results[2:]] == [None] * (n - 2)
    assert all(r.error.startswith("unparseable verdict: ") for r in results[2:-1])
    assert results[-1].error == "judge: timeout"
    assert reward.counters == {
        "scored": 2,
        "judge_failures": 1,
        "parse_failures": len(BAD_REPLIES),
        "invalid_inputs": 0,
    }


def test_behaviour_invalid_inputs_are_not_sent():
    judge = FakeJudge([JudgeReply(GOOD, None, False)])
    reward = BehaviourReward(judge)
    results = reward.score_batch(
        [episode("hurry"), episode("hurry"), Episode("p", "d", 0, 0)],
        [prompt(), prompt(behavior=BEHAVIOR), prompt(behavior=BEHAVIOR)],
    )
    assert [r.value for r in results] == [None, pytest.approx(0.55), None]
    assert results[0].error == "prompt 'p' has no behavior to judge"
    assert len(judge.asked[0]) == 1
    assert reward.counters["invalid_inputs"] == 2


def test_judge_prompt_contains_behaviour_instructions_and_transcript():
    (message,) = judge_messages(episode("hurry up!"), prompt(text="Book a flight.", behavior=BEHAVIOR))
    assert message["role"] == "user"
    for part in (
        "Behaviour: impatience",
        "Description: gets short with slow answers",
        "Book a flight.",
        "ASSISTANT: Sure.\n\nUSER: hurry up!",
        '"described_instead_of_enacted"',
        "ONLY a JSON object",
    ):
        assert part in message["content"]

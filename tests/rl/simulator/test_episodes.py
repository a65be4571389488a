from dataclasses import dataclass

import pytest

from megatron_mimesis.rl.chat import ChatRenderer, PrivilegedTextLeak
from megatron_mimesis.rl.simulator.counterparts import CounterpartReply, ScriptedCounterpart
from megatron_mimesis.rl.simulator.episodes import EpisodeRunner, fold_rows
from megatron_mimesis.rl.types import PolicyTurn, SamplingParams, TrainingRow
from tests.rl.fakes import (
    END_THINK,
    EOT,
    IM_END,
    IM_START,
    THINK,
    RecordingCounterpart,
    ScriptedEngine,
    char_tokenizer,
    ids,
    logprobs_for,
)

NL = ids("\n")
USER_HEADER = [IM_START, *ids("user\n"), THINK, *NL]  # the generation header with thinking on


@dataclass
class Task:
    id: str
    domain: str
    prompt: str
    opening: str | None = None


def message(role: str, content: str) -> list[int]:
    return [IM_START, *ids(f"{role}\n{content}"), IM_END, *NL]


def said(text: str) -> CounterpartReply:
    return CounterpartReply(text, False)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer, thinking=True)


def runner(engine, renderer, counterpart, max_turns, **kwargs) -> EpisodeRunner:
    return EpisodeRunner(engine, renderer, counterpart, SamplingParams(max_new_tokens=32), max_turns, **kwargs)


def test_each_turn_sees_exactly_the_public_transcript(tokenizer, renderer):
    engine = ScriptedEngine(tokenizer, [["plan\n</think>\n\nI need a cab."], ["go\n</think>\n\nTo the zoo. <END>"]])
    counterpart = RecordingCounterpart(lambda transcript: said("Where to?"))
    [episode] = runner(engine, renderer, counterpart, max_turns=4).run([Task("p0", "taxi", "Be Bo.", "Hi.")], 1, 0)

    first = [*message("system", "Be Bo."), *message("assistant", "Hi.")]
    second = [*first, *message("user", "I need a cab."), *message("assistant", "Where to?")]
    assert [prompts for prompts, _ in engine.calls] == [[first + USER_HEADER], [second + USER_HEADER]]
    assert episode.turns == [
        PolicyTurn(
            context_ids=first + USER_HEADER,
            response_ids=[*ids("plan\n"), END_THINK, *ids("\n\nI need a cab."), IM_END],
            response_logprobs=logprobs_for(22),
            thinking="plan",
            utterance="I need a cab.",
            finish_reason="stop",
        ),
        PolicyTurn(
            context_ids=second + USER_HEADER,
            response_ids=[*ids("go\n"), END_THINK, *ids("\n\nTo the zoo. <END>"), IM_END],
            response_logprobs=logprobs_for(24),
            thinking="go",
            utterance="To the zoo.",
            finish_reason="stop",
        ),
    ]
    assert episode.transcript == [
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "I need a cab."},
        {"role": "assistant", "content": "Where to?"},
        {"role": "user", "content": "To the zoo."},
    ]
    assert episode.finished == "stop_marker"
    assert (episode.prompt_id, episode.domain, episode.group_id, episode.rollout_id) == ("p0", "taxi", 0, 0)
    assert counterpart.batches == [[episode.transcript[:2]]]


def test_the_simulator_may_open_and_its_system_prompt_comes_from_the_prompt_fn(tokenizer):
    renderer = ChatRenderer(tokenizer, thinking=False)
    engine = ScriptedEngine(tokenizer, [["Hey."]])
    run = runner(engine, renderer, ScriptedCounterpart(lambda t: "Yes?"), 1, policy_system_prompt_fn=lambda p: p.id)
    [episode] = run.run([Task("you are Al", "d", "ignored")], 1, 0)
    [([context], sampling)] = engine.calls
    assert context == [*message("system", "you are Al"), IM_START, *ids("user\n")]
    assert episode.turns[0].thinking is None
    assert episode.finished == "max_turns"
    assert episode.transcript == [{"role": "user", "content": "Hey."}]


def batch_run(tokenizer, renderer):
    """Two prompts x two rollouts over three turns: rollout 1 stops, rollout 2 never closes its thinking,
    the counterpart ends rollout 3, and rollout 0 talks until max_turns."""
    engine = ScriptedEngine(
        tokenizer,
        [
            ["SECRET a</think>One.", "SECRET b</think>Bye <END>", "SECRET c never closed", "SECRET d</think>Two."],
            ["SECRET e</think>Three."],
            ["SECRET f</think>Four."],
        ],
    )
    counterpart = RecordingCounterpart(
        lambda t: CounterpartReply("Done!", True) if t[-1]["content"] == "Two." else said("Go on.")
    )
    prompts = [Task("p0", "taxi", "Be Bo."), Task("p1", "shop", "Be Cy.", "Hello.")]
    episodes = runner(engine, renderer, counterpart, max_turns=3).run(prompts, rollouts_per_prompt=2, step_seed=5)
    return engine, counterpart, episodes


def test_turns_are_batched_over_active_episodes_and_each_ending_is_recorded(tokenizer, renderer):
    engine, counterpart, episodes = batch_run(tokenizer, renderer)
    assert [len(prompts) for prompts, _ in engine.calls] == [4, 1, 1]
    assert [sampling.seed for _, sampling in engine.calls] == [15, 16, 17]
    assert {sampling.stop_token_ids for _, sampling in engine.calls} == {(IM_END, EOT)}
    assert [[t[-1]["content"] for t in batch] for batch in counterpart.batches] == [["One.", "Two."], ["Three."]]
    assert [(e.group_id, e.rollout_id) for e in episodes] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert [e.finished for e in episodes] == [
        "max_turns",
        "stop_marker",
        "error: empty utterance (finish_reason stop)",
        "counterpart_done",
    ]
    assert [len(e.turns) for e in episodes] == [3, 1, 1, 1]
    assert episodes[1].transcript == [{"role": "user", "content": "Bye"}]
    assert episodes[2].transcript == [{"role": "assistant", "content": "Hello."}]
    assert episodes[2].turns[0].thinking == "SECRET c never closed"
    assert episodes[3].transcript[-1] == {"role": "assistant", "content": "Done!"}


def test_thinking_never_reaches_the_counterpart_nor_later_contexts(tokenizer, renderer):
    engine, counterpart, episodes = batch_run(tokenizer, renderer)
    shown = [m["content"] for batch in counterpart.batches for transcript in batch for m in transcript]
    assert shown and not any("SECRET" in text or "think>" in text for text in shown)
    for prompts, _ in engine.calls:
        assert not any("SECRET" in tokenizer.decode(prompt) for prompt in prompts)
    assert all("SECRET" in turn.thinking for e in episodes for turn in e.turns)


def test_a_tampered_transcript_is_refused_before_it_reaches_the_counterpart(tokenizer, renderer):
    engine = ScriptedEngine(tokenizer, [["a</think>Hi."], ["b</think>Well?"]])
    counterpart = RecordingCounterpart(lambda t: said("<think>planted</think> sure"))
    with pytest.raises(PrivilegedTextLeak, match="message 1 \\(assistant\\) contains a think marker"):
        runner(engine, renderer, counterpart, max_turns=3).run([Task("p", "d", "S")], 1, 0)
    assert len(counterpart.batches) == 1


def test_a_counterpart_error_ends_only_its_episode(tokenizer, renderer):
    engine = ScriptedEngine(tokenizer, [["a</think>x", "a</think>y"], ["b</think>z"]])
    counterpart = RecordingCounterpart(
        lambda t: CounterpartReply(None, False, "HTTP 500") if t[-1]["content"] == "x" else said("ok")
    )
    episodes = runner(engine, renderer, counterpart, max_turns=2).run([Task("p", "d", "S")], 2, 0)
    assert [e.finished for e in episodes] == ["error: counterpart: HTTP 500", "max_turns"]
    assert episodes[0].transcript == [{"role": "user", "content": "x"}]


def test_fold_rows_gives_one_row_per_turn_of_each_scored_episode(tokenizer, renderer):
    _, _, episodes = batch_run(tokenizer, renderer)
    for episode, reward in zip(episodes, [1.0, 0.5, None, 0.0], strict=True):
        episode.reward = reward
    rows, stats = fold_rows(episodes)
    assert stats == {"episodes": 4, "rows": 5, "unscored_episodes": 1}
    turns = [(e, t) for e in episodes if e.reward is not None for t in e.turns]
    assert rows == [
        TrainingRow(e.group_id, e.rollout_id, t.context_ids, t.response_ids, t.response_logprobs, e.reward, e.domain)
        for e, t in turns
    ]
    assert [(r.group_id, r.rollout_id, r.reward, r.domain) for r in rows] == [
        (0, 0, 1.0, "taxi"),
        (0, 0, 1.0, "taxi"),
        (0, 0, 1.0, "taxi"),
        (0, 1, 0.5, "taxi"),
        (1, 3, 0.0, "shop"),
    ]
    assert len({tuple(r.context_ids) for r in rows[:3]}) == 3


def test_max_turns_must_be_positive(tokenizer, renderer):
    with pytest.raises(ValueError, match="max_turns must be at least 1, got 0"):
        runner(ScriptedEngine(tokenizer, []), renderer, ScriptedCounterpart(lambda t: "x"), max_turns=0)

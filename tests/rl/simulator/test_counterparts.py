import pytest

from megatron_mimesis.rl.chat import ChatRenderer
from megatron_mimesis.rl.simulator.counterparts import (
    CounterpartReply,
    EngineCounterpart,
    OpenAICounterpart,
    ScriptedCounterpart,
)
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.fakes import EOT, IM_END, IM_START, THINK, FakeOpenAIServer, ScriptedEngine, char_tokenizer, ids

TRANSCRIPTS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "assistant", "content": "Welcome."}, {"role": "user", "content": "book a table"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def server():
    with FakeOpenAIServer() as fake:
        yield fake


def test_scripted_counterpart_replies_and_ends_with_none():
    counterpart = ScriptedCounterpart(lambda t: None if t[-1]["content"] == "bye" else "re: " + t[-1]["content"])
    replies = counterpart.reply_many([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]])
    assert replies == [CounterpartReply("re: hi", False), CounterpartReply(None, True)]


def test_openai_counterpart_sends_the_transcript_from_the_assistants_side(server):
    counterpart = OpenAICounterpart(server.base_url, "fixed-assistant", system_prompt="You are a waiter.")
    replies = counterpart.reply_many(TRANSCRIPTS)
    assert replies == [CounterpartReply("ok hi", False), CounterpartReply("ok book a table", False)]
    sent = sorted((r["messages"] for r in server.requests), key=len)
    assert sent == [
        [{"role": "system", "content": "You are a waiter."}, {"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "You are a waiter."},
            {"role": "assistant", "content": "Welcome."},
            {"role": "user", "content": "book a table"},
        ],
    ]
    assert {r["model"] for r in server.requests} == {"fixed-assistant"}
    assert {(r["max_tokens"], r["temperature"]) for r in server.requests} == {(512, 0.7)}


def test_openai_counterpart_keeps_batch_order_under_concurrency(server):
    transcripts = [[{"role": "user", "content": f"n{k}"}] for k in range(12)]
    replies = OpenAICounterpart(server.base_url, "m", concurrency=4).reply_many(transcripts)
    assert [r.text for r in replies] == [f"ok n{k}" for k in range(12)]


def test_openai_counterpart_drops_model_thinking_and_honours_the_end_marker():
    replies = {"a": "<think>they seem lost</think>Can I help?", "b": "Goodbye! [DONE]", "c": "[DONE]", "d": " "}
    with FakeOpenAIServer(reply=lambda messages: replies[messages[-1]["content"]]) as fake:
        counterpart = OpenAICounterpart(fake.base_url, "m", end_marker="[DONE]")
        got = counterpart.reply_many([[{"role": "user", "content": key}] for key in "abcd"])
    assert got == [
        CounterpartReply("Can I help?", False),
        CounterpartReply("Goodbye!", True),
        CounterpartReply(None, True),
        CounterpartReply(None, False, "empty reply"),
    ]


def test_openai_counterpart_retries_a_server_error(server):
    server.failures = [500]
    replies = OpenAICounterpart(server.base_url, "m").reply_many([[{"role": "user", "content": "hi"}]])
    assert replies == [CounterpartReply("ok hi", False)]
    assert len(server.requests) == 2


def test_openai_counterpart_returns_a_permanent_failure_as_an_error(server):
    server.broken = True
    replies = OpenAICounterpart(server.base_url, "m", max_retries=2).reply_many(TRANSCRIPTS)
    assert [(r.text, r.done) for r in replies] == [(None, False), (None, False)]
    assert all(r.error.startswith("InternalServerError: ") for r in replies)
    assert len(server.requests) == 2 * 3


def test_openai_counterpart_returns_an_unreachable_server_as_an_error():
    with FakeOpenAIServer() as fake:
        base_url = fake.base_url
    [reply] = OpenAICounterpart(base_url, "m", timeout_s=2, max_retries=0).reply_many(TRANSCRIPTS[:1])
    assert reply.error.startswith("APIConnectionError: ")


def test_engine_counterpart_renders_the_assistant_prompt_and_strips_thinking(tokenizer):
    renderer = ChatRenderer(tokenizer, thinking=True)
    engine = ScriptedEngine(tokenizer, [["ok\n</think>\n\nSure.", "x</think>Bye END", "cut off"]])
    counterpart = EngineCounterpart(
        engine, renderer, SamplingParams(max_new_tokens=9), system_prompt="S", end_marker="END"
    )
    transcripts = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "ok"}],
        [{"role": "user", "content": "?"}],
    ]
    replies = counterpart.reply_many(transcripts)
    assert replies == [
        CounterpartReply("Sure.", False),
        CounterpartReply("Bye", True),
        CounterpartReply(None, False, "empty reply"),
    ]
    [(prompts, sampling)] = engine.calls
    history = [IM_START, *ids("system\nS"), IM_END, *ids("\n"), IM_START, *ids("user\nhi"), IM_END, *ids("\n")]
    assert prompts[0] == [*history, IM_START, *ids("assistant\n"), THINK, *ids("\n")]
    assert sampling == SamplingParams(max_new_tokens=9, stop_token_ids=(IM_END, EOT))

"""The agent's chat format per family: Qwen3's own template (tests/fixtures/qwen3_chat_template.jinja, the released
one) with its JSON tool calls, thinking kept only within the current tool chain, and rows that are exactly the
engine's tokens; the tool-call parsers of both formats, with the unparsed blocks counted."""

from pathlib import Path

import pytest

from megatron_mimesis.models.presets import get_preset
from megatron_mimesis.rl.agent.agent_chat import PiecewiseAgentChat, TemplateAgentChat, agent_chat
from megatron_mimesis.rl.agent.csd import teacher_context
from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner, agent_rows, score_episodes
from megatron_mimesis.rl.agent.tool_calls import JsonCalls, XmlCalls, parse_tool_calls
from megatron_mimesis.rl.envs.base import ToolCall
from megatron_mimesis.rl.envs.toy import ToySuite, code_of, toy_user
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.fakes import IM_END, ScriptedEngine, char_tokenizer

QWEN3_TEMPLATE = Path(__file__).parents[2] / "fixtures" / "qwen3_chat_template.jinja"
SUITE = ToySuite(num_tasks=2, max_words=3, seed=0)
ITEM = SUITE.items[0]
CODE = code_of(ITEM)
SYSTEM = "You are a helpful agent. Answer briefly."


def qwen3_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    return tokenizer


def qwen3_chat(thinking: bool = True):
    return agent_chat(get_preset("qwen3-tiny").family.chat, qwen3_tokenizer(), thinking)


TURNS = [
    f'<think>\nI should look it up.\n</think>\n\n<tool_call>\n{{"name": "lookup", "arguments": {{"item": "{ITEM}"}}}}\n'
    "</tool_call>",
    "<think>\nThe tool answered.\n</think>\n\nOne moment.",
    f"<think>\nJust say it.\n</think>\n\nCode {CODE}",
]
TOOLS_BLOCK = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
               "function signatures within <tools></tools> XML tags:\n<tools>\n"
               '{"type": "function", "function": {"name": "lookup", "description": "Return the access code of an '
               'item.", "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": '
               '["item"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments '
               'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
               "<args-json-object>}\n</tool_call>")
CALL = f'<tool_call>\n{{"name": "lookup", "arguments": {{"item": "{ITEM}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def episode_run():
    chat = qwen3_chat()
    engine = ScriptedEngine(chat.tokenizer, [[t] for t in TURNS])
    runner = AgentEpisodeRunner(engine, chat, toy_user(), SamplingParams(), max_agent_turns=5)
    (episode,) = runner.run(SUITE, ["toy-0"], rollouts_per_task=1, step_seed=0)
    return chat, engine, episode


def test_a_three_turn_episode_with_thinking_trains_on_exactly_the_engines_tokens(episode_run):
    chat, engine, episode = episode_run
    assert episode.termination == "user_stop" and len(episode.turns) == 3
    assert score_episodes([episode]) == {}
    rows = [row for row, _, _ in agent_rows([episode], gamma=0.8, domain="toy")]
    prompts = [prompts[0] for prompts, _ in engine.calls]
    for row, turn, prompt, text in zip(rows, episode.turns, prompts, TURNS, strict=True):
        assert row.context_ids == turn.context_ids == prompt  # the context the engine was given
        assert row.response_ids == chat.tokenizer.encode(text, add_special_tokens=False) + [IM_END]  # what it made
    # the model opened its think block itself (Qwen3's prompt does not): the row holds it
    assert all(chat.tokenizer.decode(r.response_ids).startswith("<think>\n") for r in rows)
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant",
                                                     "user"]
    assert episode.messages[1]["tool_calls"] == [ToolCall("lookup", {"item": ITEM}, "0-0-0")]
    assert episode.messages[2]["content"] == CODE and episode.messages[5]["content"] == f"Code {CODE}"
    assert episode.agent_thinking == {1: "I should look it up.", 3: "The tool answered.", 5: "Just say it."}


def test_contexts_are_qwen3s_template_thinking_kept_only_in_the_current_tool_chain(episode_run):
    chat, _, episode = episode_run
    user_1, user_2 = episode.messages[0]["content"], episode.messages[4]["content"]
    system = f"<|im_start|>system\n{SYSTEM}\n\n{TOOLS_BLOCK}<|im_end|>\n"
    first = f"{system}<|im_start|>user\n{user_1}<|im_end|>\n<|im_start|>assistant\n"
    # within the tool chain the first turn's thinking is shown back, as Qwen3's template renders it
    second = (f"{first}<think>\nI should look it up.\n</think>\n\n{CALL}<|im_end|>\n"
              f"<|im_start|>user\n<tool_response>\n{CODE}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # after the user's next message the earlier turns are shown without their thinking
    third = (f"{first}{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\n{CODE}\n</tool_response><|im_end|>\n"
             f"<|im_start|>assistant\nOne moment.<|im_end|>\n<|im_start|>user\n{user_2}<|im_end|>\n"
             f"<|im_start|>assistant\n")
    assert [chat.tokenizer.decode(t.context_ids) for t in episode.turns] == [first, second, third]


def test_the_teacher_context_only_adds_the_note_to_the_system_message(episode_run):
    chat, _, episode = episode_run
    for t, turn in enumerate(episode.turns):
        teacher = chat.tokenizer.decode(teacher_context(chat, episode, t, "Give the code."))
        student = chat.tokenizer.decode(turn.context_ids)
        assert teacher == student.replace(f"{SYSTEM}\n\n", f"{SYSTEM}\n\n# Coach's note\nGive the code.\n\n", 1)


def test_thinking_off_closes_an_empty_think_block_in_the_prompt():
    chat = qwen3_chat(thinking=False)
    task = SUITE.make("toy-0").task
    text = chat.tokenizer.decode(chat.context(task, [{"role": "user", "content": "hi"}]))
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reply = chat.read("Code 1<|im_end|>", "0-0")
    assert (reply.thinking, reply.text, reply.calls, reply.unparsed_calls) == (None, "Code 1", [], 0)


def test_each_family_gets_its_format():
    assert isinstance(agent_chat(get_preset("tiny").family.chat, char_tokenizer(), True), PiecewiseAgentChat)
    assert isinstance(qwen3_chat(), TemplateAgentChat)
    with pytest.raises(ValueError, match="no chat template"):
        agent_chat(get_preset("qwen3-tiny").family.chat, char_tokenizer(), True)


@pytest.mark.parametrize("parser", [XmlCalls, JsonCalls])
def test_calls_round_trip_through_their_format(parser):
    calls = [ToolCall("lookup", {"item": "alpha", "n": 3, "tags": ["a", "b"]}, "x-0"), ToolCall("ping", {}, "x-1")]
    parsed = parse_tool_calls(f"Let me check.\n{parser.format(calls)}", "x", parser)
    assert (parsed.text, parsed.calls, parsed.unparsed) == ("Let me check.", calls, 0)


@pytest.mark.parametrize(("text", "calls", "unparsed"), [
    ('<tool_call>\n{"name": "lookup", "arguments": "{\\"item\\": \\"kilo\\"}"}\n</tool_call>',
     [ToolCall("lookup", {"item": "kilo"}, "p-0")], 0),  # arguments as a JSON string, as some servers write them
    ('<tool_call>\n{"name": "lookup", "arguments": {"item": "kilo"}\n</tool_call>', [], 1),  # a brace short
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', [], 1),  # no name
    ('<tool_call>\n{"name": "lookup", "arguments": [1]}\n</tool_call> and <tool_call>\n{"name": "a"}', [
        ToolCall("a", {}, "p-0")], 1),  # arguments not an object; an unclosed last block still parses
])
def test_hermes_blocks_that_are_not_calls_stay_in_the_text_and_are_counted(text, calls, unparsed):
    parsed = parse_tool_calls(text, "p", JsonCalls)
    assert (parsed.calls, parsed.unparsed) == (calls, unparsed)
    assert parsed.text.count("<tool_call>") == unparsed


def test_qwen3_coder_blocks_without_a_function_are_counted():
    parsed = parse_tool_calls("<tool_call>\nlookup alpha\n</tool_call> ok", "p", XmlCalls)
    assert (parsed.text, parsed.calls, parsed.unparsed) == ("<tool_call>\nlookup alpha\n</tool_call> ok", [], 1)


"""An export is a servable user simulator: the chat template it carries renders a request in the user-simulator
convention (system, the agent as ``user``, the simulator as ``assistant``) into data_prep's training rendering
token for token, through transformers' own ``apply_chat_template`` (what vLLM's server calls); thinking follows
the checkpoint's training; generation_config.json stops where a turn ends and samples as the recipe did."""

import json
import shutil

import pytest
from transformers import AutoTokenizer, GenerationConfig

from data_prep.records import Turn
from data_prep.render import end_turns, with_end_marker
from data_prep.tokenizer import ENDOFTEXT, IM_END, THINK, TextEncoder
from megatron_mimesis.checkpoint.serving import (
    TEMPLATE_FILE,
    install_chat_template,
    make_servable,
    simulator_chat_template,
)
from megatron_mimesis.eval.heldout import input_corpora, read_conversations
from megatron_mimesis.rl.chat import ChatRenderer, flip_roles
from tests.rendering import prompt_of_last_turn, training_samples

SYSTEM = "You are Dana, 34, a nurse on night shifts. You want to move your dentist appointment to a Friday."
HAND_WRITTEN = [  # spacing, digits, unicode, markdown, a system turn, an opener by the user and by the agent
    [{"role": "system", "content": SYSTEM}, {"role": "assistant", "content": "Hi! How can I help you today?"},
     {"role": "user", "content": "hey. need to move my appointment on the 14th  "},
     {"role": "assistant", "content": "Sure - which day works?\n\n- Thu 3pm\n- **Fri 9am**"},
     {"role": "user", "content": " friday, 9 is fine ☕ thx"}],
    [{"role": "user", "content": "¿Hablas español? 🙂"}, {"role": "assistant", "content": "Un poco."},
     {"role": "user", "content": "ok\tcool...  so   what's 12*7?"}],
]


@pytest.fixture(scope="module")
def conversations():
    """The hand-written ones and 24 held-out chit-chat renderings, each cut after its last user turn. Content that
    starts with a newline, or spells a special token, tokenizes differently inside a rendered string: those are
    the documented exceptions and left out here."""
    held_out = read_conversations(input_corpora([], valid_fraction=0.9, max_conversations=40))
    found = list(HAND_WRITTEN)
    for rendering in held_out.renderings[:24]:
        conversation, roles = rendering.conversation, rendering.roles
        turns = [{"role": role, "content": turn.content} for role, turn in zip(roles, conversation.turns, strict=True)]
        users = [i for i, t in enumerate(turns) if t["role"] == "user"]
        if users and not any(t["content"].startswith("\n") or "<|" in t["content"] for t in turns):
            found.append(turns[:users[-1] + 1])
    assert len(found) >= 20
    return found


def _tokenizer(tiny_dataset, directory, thinking):
    shutil.copytree(tiny_dataset / "tokenizer", directory)
    install_chat_template(directory, simulator_chat_template(thinking))
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def mid_trained(tiny_dataset, tmp_path_factory):
    return _tokenizer(tiny_dataset, tmp_path_factory.mktemp("tok") / "midtrain", thinking=False)


@pytest.fixture(scope="module")
def thought_supervised(tiny_dataset, tmp_path_factory):
    return _tokenizer(tiny_dataset, tmp_path_factory.mktemp("tok") / "sft", thinking=True)


def _ids(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def test_a_flipped_request_renders_the_training_prompt_of_every_user_turn(mid_trained, conversations, tiny_dataset):
    tokenizer_dir = tiny_dataset / "tokenizer"
    renderer = ChatRenderer(mid_trained, thinking=False)
    checked = 0
    for turns in conversations:
        for i, turn in enumerate(turns):
            if turn["role"] != "user" or i == 0:  # transformers refuses an empty request (an opener, no system)
                continue
            expected = prompt_of_last_turn(turns[:i + 1], tokenizer_dir)
            assert _ids(mid_trained, flip_roles(turns[:i]), add_generation_prompt=True) == expected, (turns, i)
            checked += 1
        # the project's own rollout rendering agrees (each conversation ends with a user turn)
        assert renderer.user_prompt(turns[:-1]) == prompt_of_last_turn(turns, tokenizer_dir)
    assert checked > 60


def test_a_whole_conversation_renders_the_training_row_in_both_conventions(mid_trained, conversations, tiny_dataset):
    for turns in conversations:
        ((tokens, spans),) = training_samples(turns, tiny_dataset / "tokenizer", complete=False)
        assert _ids(mid_trained, flip_roles(turns)) == tokens
        assert _ids(mid_trained, turns, simulator_role="user") == tokens
        if len(turns) > 1:
            assert _ids(mid_trained, turns[:-1], simulator_role="user", add_generation_prompt=True) == \
                tokens[:spans[-1][0]]
        # a conversation the simulator ended: its last turn as it wrote it, with the marker, is the complete row
        ((ended, _),) = training_samples(turns, tiny_dataset / "tokenizer")
        (last,) = end_turns(tuple(Turn(t["role"], t["content"]) for t in turns), "role", complete=True)
        written = [{**t, "content": with_end_marker(t["content"])} if i == last else t for i, t in enumerate(turns)]
        assert ended != tokens and _ids(mid_trained, flip_roles(written)) == ended


def test_thinking_opens_the_sft_target_and_earlier_thoughts_are_not_shown(thought_supervised, mid_trained,
                                                                          tiny_dataset):
    tokenizer_dir = tiny_dataset / "tokenizer"
    turns = [{"role": "system", "content": SYSTEM},
             {"role": "assistant", "content": "Hi! How can I help you today?"},
             {"role": "user", "content": "need to move an appointment", "thinking": "Start vague, as Dana would."},
             {"role": "assistant", "content": "Which one?"},
             {"role": "user", "content": "the dentist, on the 14th", "thinking": "Now give the date."}]
    expected = prompt_of_last_turn(turns, tokenizer_dir, thinking=True)
    assert expected[-2] == TextEncoder(tokenizer_dir).special[THINK]
    # a client sends the simulator's earlier turn back as it got it, thoughts included: they are not rendered
    sent = [{"role": t["role"], "content": (f"<think>\n{t['thinking']}\n</think>\n\n" if "thinking" in t else "")
             + t["content"]} for t in turns[:-1]]
    assert _ids(thought_supervised, flip_roles(sent), add_generation_prompt=True) == expected
    # or, from a server with a reasoning parser, the content after </think>: it still starts with its newlines
    parsed = [{"role": t["role"], "content": ("\n\n" if "thinking" in t else "") + t["content"]} for t in turns[:-1]]
    assert _ids(thought_supervised, flip_roles(parsed), add_generation_prompt=True) == expected
    assert ChatRenderer(thought_supervised, thinking=True).user_prompt(turns[:-1]) == expected
    # thinking is the export's default and a request can switch it either way
    plain = prompt_of_last_turn(turns, tokenizer_dir)
    assert _ids(thought_supervised, flip_roles(sent), add_generation_prompt=True, enable_thinking=False) == plain
    assert _ids(mid_trained, flip_roles(sent), add_generation_prompt=True) == plain
    assert _ids(mid_trained, flip_roles(sent), add_generation_prompt=True, enable_thinking=True) == expected


def test_a_message_without_content_renders_as_empty(mid_trained):
    """An OpenAI client sends ``content: null`` for a message with only tool calls; transformers drops the key, so the
    template must take an undefined content as empty, not fail on it."""
    empty = _ids(mid_trained, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
                 add_generation_prompt=True)
    assert empty == _ids(mid_trained, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
                         add_generation_prompt=True)


def test_what_the_template_cannot_render_is_refused_naming_it(mid_trained):
    with pytest.raises(Exception, match="not 'tool' \\(message 1\\)"):
        _ids(mid_trained, [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}])
    with pytest.raises(Exception, match="simulator_role must be 'assistant' or 'user', not 'agent'"):
        _ids(mid_trained, [{"role": "user", "content": "hi"}], simulator_role="agent")
    with pytest.raises(Exception, match="text content only \\(message 0\\)"):
        _ids(mid_trained, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


@pytest.mark.parametrize(("train", "thinking", "template", "sampling"), [
    (None, False, True, (1.0, 1.0)),  # an HF import: a starting point for user-side training
    ({"stage": "midtrain"}, False, True, (1.0, 1.0)),
    ({"stage": "sft"}, True, True, (1.0, 1.0)),
    ({"stage": "rl_simulator", "thinking": True, "temperature": 0.7, "top_p": 0.9}, True, True, (0.7, 0.9)),
    ({"stage": "rl_simulator", "thinking": False, "temperature": 1.0, "top_p": 1.0}, False, True, (1.0, 1.0)),
    ({"stage": "rl_agent", "thinking": True, "temperature": 1.0, "top_p": 1.0}, None, False, (1.0, 1.0)),
])
def test_the_checkpoint_decides_thinking_template_and_sampling(train, thinking, template, sampling, tiny_dataset,
                                                               tmp_path):
    out = tmp_path / "export"
    shutil.copytree(tiny_dataset / "tokenizer", out)
    special = TextEncoder(out).special
    make_servable(out, {} if train is None else {"train": train}, special)
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [special[IM_END], special[ENDOFTEXT]]
    assert generation.pad_token_id == generation.bos_token_id == special[ENDOFTEXT]
    assert generation.do_sample and (generation.temperature, generation.top_p) == sampling
    assert generation.top_k is None  # untruncated by rank, as every rollout engine of the recipe samples
    if not template:  # the agent keeps the tokenizer's own template (the tiny one has none)
        assert not (out / TEMPLATE_FILE).exists() and "chat_template" not in json.loads(
            (out / "tokenizer_config.json").read_text())
        return
    text = (out / TEMPLATE_FILE).read_text()
    assert text == simulator_chat_template(thinking) == json.loads(
        (out / "tokenizer_config.json").read_text())["chat_template"]

import pytest

from megatron_mimesis.rl.chat import ChatRenderer, PrivilegedTextLeak, check_public, strip_thinking
from tests.rl.fakes import END_THINK, EOT, IM_END, IM_START, THINK, char_tokenizer, ids

NL = ids("\n")


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def test_char_tokenizer_ids_are_hand_writable(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi", add_special_tokens=False) == [1, 27, 25, 11, 24, 5, 14, 15]
    assert ids("user\nhi") == [27, 25, 11, 24, 5, 14, 15]


def test_render_messages_encodes_each_piece_between_header_and_closing(tokenizer):
    renderer = ChatRenderer(tokenizer, thinking=False)
    messages = [{"role": "system", "content": "Be Ann."}, {"role": "assistant", "content": "Hi!"}]
    system = [IM_START, *ids("system\n"), *ids("Be Ann."), IM_END, *NL]
    assistant = [IM_START, *ids("assistant\n"), *ids("Hi!"), IM_END, *NL]
    assert renderer.render_messages(messages) == system + assistant


def test_special_token_text_in_content_stays_plain_text(tokenizer):
    renderer = ChatRenderer(tokenizer, thinking=False)
    rendered = renderer.render_messages([{"role": "user", "content": "a<|im_end|>"}])
    assert rendered == [IM_START, *ids("user\n"), *ids("a<|im_end|>"), IM_END, *NL]


def test_generation_prompts_open_the_think_block_only_with_thinking(tokenizer):
    messages = [{"role": "system", "content": "task"}]
    history = [IM_START, *ids("system\n"), *ids("task"), IM_END, *NL]
    plain = ChatRenderer(tokenizer, thinking=False)
    thinking = ChatRenderer(tokenizer, thinking=True)
    assert plain.user_prompt(messages) == [*history, IM_START, *ids("user\n")]
    assert plain.assistant_prompt(messages) == [*history, IM_START, *ids("assistant\n")]
    assert thinking.user_prompt(messages) == [*history, IM_START, *ids("user\n"), THINK, *NL]
    assert thinking.assistant_prompt(messages) == [*history, IM_START, *ids("assistant\n"), THINK, *NL]


def test_stop_token_ids(tokenizer):
    assert ChatRenderer(tokenizer, thinking=True).stop_token_ids == (IM_END, EOT)
    assert END_THINK == tokenizer.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plan it\n</think>\n\nHello there.<|im_end|>", ("plan it", "Hello there.")),
        ("</think>\n\nHi", ("", "Hi")),
        ("still thinking when cut off", ("still thinking when cut off", "")),
        ("a</think>Hi <think>b</think>you", ("a\n\nb", "Hi you")),
        ("a</think>Hi <think>b and then cut", ("a\n\nb and then cut", "Hi")),
    ],
)
def test_split_thinking_with_thinking_on(tokenizer, text, expected):
    assert ChatRenderer(tokenizer, thinking=True).split_thinking(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello there.<|im_end|>", (None, "Hello there.")),
        ("Hello there.<|endoftext|>", (None, "Hello there.")),
        ("<think>\nx\n</think>\n\nHello", ("x", "Hello")),
        ("Hi <think>x</think>you", ("x", "Hi you")),
        ("Hi <think>x never closed", ("x never closed", "Hi")),
        ("thought</think> Hello", ("thought", "Hello")),
    ],
)
def test_split_thinking_with_thinking_off_never_leaks_markers(tokenizer, text, expected):
    assert ChatRenderer(tokenizer, thinking=False).split_thinking(text) == expected


def test_strip_thinking_keeps_thoughts_in_order():
    assert strip_thinking("<think>a</think>b</think>c") == ("a\n\nb", "c")
    assert strip_thinking("a</think> <think>b</think> c") == ("a\n\nb", "c")
    assert strip_thinking("plain") == (None, "plain")


def test_check_public_accepts_plain_messages_and_rejects_privileged_ones():
    check_public([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a < b > c"}])
    with pytest.raises(PrivilegedTextLeak, match="message 1 \\(user\\) contains a think marker"):
        check_public([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "<think>secret"}])
    with pytest.raises(PrivilegedTextLeak, match="think marker"):
        check_public([{"role": "user", "content": "secret</think>hi"}])
    with pytest.raises(PrivilegedTextLeak, match="non-public fields \\['coach_note'\\]"):
        check_public([{"role": "user", "content": "hi", "coach_note": "be rude"}])

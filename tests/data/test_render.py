"""Exact token ids and target masks of the mid-training and SFT renderings, and the window planner."""

import pytest

from data_prep.records import FORMATS, to_conversation
from data_prep.render import ChatTokens, RenderStats, plan_windows, render, texts_to_encode
from tests.data.conftest import END_THINK, IM_END, IM_START, NL, THINK, conversation, ids

USER = [IM_START, *ids("user\n")]  # 6 tokens
ASSISTANT = [IM_START, *ids("assistant\n")]  # 11 tokens
SYSTEM = [IM_START, *ids("system\n")]  # 8 tokens


def rendered(encoder, record, seq_length=1000, user_speaker="role", with_thinking=False, complete=False):
    conv = to_conversation(record, "test:1", FORMATS["messages"])
    stats = RenderStats()
    encoded = encoder.encode_batch(texts_to_encode(conv, with_thinking, user_speaker, complete))
    samples = render(conv, encoded, ChatTokens.from_encoder(encoder), seq_length, user_speaker, with_thinking, stats,
                     complete)
    return samples, stats


def positions(spans):
    return [i for start, end, _ in spans for i in range(start, end)]


def test_midtrain_rendering_exact_ids_and_mask(encoder):
    samples, stats = rendered(encoder, conversation(("user", "hi"), ("assistant", "yo"), ("user", "ok")))
    assert len(samples) == 1 and stats.samples == 1
    tokens, mask = samples[0]
    # <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nok<|im_end|>\n
    assert tokens == [
        1, 27, 25, 11, 24, 5, 14, 15, 2, 5,
        1, 7, 25, 25, 15, 25, 26, 7, 20, 26, 5, 31, 21, 2, 5,
        1, 27, 25, 11, 24, 5, 21, 17, 2, 5,
    ]  # fmt: skip
    # user contents "hi", "ok" and their <|im_end|>; never the header, the newline or the assistant turn
    assert positions(mask) == [6, 7, 8, 31, 32, 33]


def test_assistant_opening_is_context_and_trailing_assistant_is_dropped(encoder):
    samples, _ = rendered(encoder, conversation(("assistant", "yo"), ("user", "hi"), ("assistant", "ok")))
    tokens, mask = samples[0]
    assert tokens == [*ASSISTANT, *ids("yo"), IM_END, NL, *USER, *ids("hi"), IM_END, NL]
    assert positions(mask) == [21, 22, 23]


def test_system_turn_is_context(encoder):
    samples, _ = rendered(encoder, conversation(("system", "be"), ("user", "hi")))
    tokens, mask = samples[0]
    assert tokens == [*SYSTEM, *ids("be"), IM_END, NL, *USER, *ids("hi"), IM_END, NL]
    assert positions(mask) == [18, 19, 20]


def test_user_speaker_first_second_both(encoder):
    record = conversation(("user", "hi"), ("assistant", "yo"))
    first_only = [*USER, *ids("hi"), IM_END, NL]
    second_as_user = [*ASSISTANT, *ids("hi"), IM_END, NL, *USER, *ids("yo"), IM_END, NL]
    assert [s[0] for s in rendered(encoder, record, user_speaker="first")[0]] == [first_only]
    assert [s[0] for s in rendered(encoder, record, user_speaker="second")[0]] == [second_as_user]
    both, stats = rendered(encoder, record, user_speaker="both")
    assert [s[0] for s in both] == [first_only, second_as_user]
    assert [positions(s[1]) for s in both] == [[6, 7, 8], [21, 22, 23]]
    assert stats.samples == 2


def test_conversation_without_user_turn_is_counted(encoder):
    samples, stats = rendered(encoder, conversation(("user", "hi")), user_speaker="second")
    assert samples == [] and stats.no_target_turn == 1


def test_sft_rendering_one_sample_per_thought_with_history_without_thinking(encoder):
    record = conversation(("user", "hi", "hm"), ("assistant", "yo"), ("user", "ok", "so"))
    samples, stats = rendered(encoder, record, with_thinking=True)
    assert stats.samples == 2
    first, second = samples
    # <|im_start|>user\n<think>\nhm\n</think>\n\nhi<|im_end|>\n
    assert first[0] == [1, 27, 25, 11, 24, 5, 3, 5, 14, 19, 5, 4, 5, 5, 14, 15, 2, 5]
    assert positions(first[1]) == list(range(6, 17))
    assert second[0] == [
        *USER, *ids("hi"), IM_END, NL,
        *ASSISTANT, *ids("yo"), IM_END, NL,
        *USER, THINK, *ids("\nso\n"), END_THINK, *ids("\n\nok"), IM_END, NL,
    ]  # fmt: skip
    assert positions(second[1]) == list(range(31, 42))


def test_sft_user_turn_without_thinking_is_context_only(encoder):
    samples, _ = rendered(
        encoder, conversation(("user", "hi"), ("assistant", "yo"), ("user", "ok", "so")), with_thinking=True
    )
    assert len(samples) == 1
    assert positions(samples[0][1]) == list(range(31, 42))


def test_special_token_text_in_content_is_plain_text(encoder):
    samples, _ = rendered(encoder, conversation(("user", "<|im_end|>")))
    tokens, _ = samples[0]
    assert tokens[6:16] == ids("<|im_end|>") and tokens.count(IM_END) == 1


def test_long_conversation_keeps_recent_context_and_whole_targets(encoder):
    # turn lengths: user "aaaa" 12, assistant "bbbb" 17, user "cccc" 12, assistant "dd" 15, user "ee" 10
    record = conversation(
        ("user", "aaaa"), ("assistant", "bbbb"), ("user", "cccc"), ("assistant", "dd"), ("user", "ee")
    )
    samples, stats = rendered(encoder, record, seq_length=44)
    assert stats.samples == 2 and stats.overlong_target_turns == 0
    (tokens_a, mask_a), (tokens_b, mask_b) = samples
    # window 1: turns 0-2 (41 tokens); turn 3+4 would need 66
    assert tokens_a == [
        *USER,
        *ids("aaaa"),
        IM_END,
        NL,
        *ASSISTANT,
        *ids("bbbb"),
        IM_END,
        NL,
        *USER,
        *ids("cccc"),
        IM_END,
        NL,
    ]
    assert positions(mask_a) == [6, 7, 8, 9, 10, 35, 36, 37, 38, 39]
    # window 2: at most half the row (22) of context -> only "dd" (15) before "ee"; "cccc" is not repeated
    assert tokens_b == [*ASSISTANT, *ids("dd"), IM_END, NL, *USER, *ids("ee"), IM_END, NL]
    assert positions(mask_b) == [21, 22, 23]


def test_target_longer_than_seq_length_is_counted_not_cut(encoder):
    record = conversation(("user", "hi"), ("assistant", "yo"), ("user", "x" * 40))
    samples, stats = rendered(encoder, record, seq_length=30)
    assert stats.overlong_target_turns == 1
    assert [s[0] for s in samples] == [[*USER, *ids("hi"), IM_END, NL]]


END = ids(" <END>")  # the end marker as the content's continuation: " <END>" after the user's last words


def test_the_last_user_turn_of_a_complete_conversation_ends_it_with_the_marker(encoder):
    # the assistant spoke last: the user's last turn is still the one after which they left
    record = conversation(("user", "hi"), ("assistant", "yo"), ("user", "ok"), ("assistant", "bye"))
    (sample,), stats = rendered(encoder, record, complete=True)
    tokens, spans = sample
    assert tokens == [
        *USER, *ids("hi"), IM_END, NL,
        *ASSISTANT, *ids("yo"), IM_END, NL,
        *USER, *ids("ok"), *END, IM_END, NL,
    ]  # fmt: skip
    # the marker and <|im_end|> are targets with the words; "hi" carries none
    assert positions(spans) == [6, 7, 8, *range(31, 31 + 2 + len(END) + 1)]
    assert [turn for _, _, turn in spans] == [0, 2]
    assert stats.ended == 1 and sum(stats.not_ended.values()) == 0
    # the same conversation from a source that may have cut it: no marker, counted as such
    (sample,), stats = rendered(encoder, record, complete=False)
    assert sample[0][-4:] == [*ids("ok"), IM_END, NL] and stats.ended == 0
    assert stats.not_ended["source_incomplete"] == 1


def test_each_rendering_ends_at_its_own_users_last_turn(encoder):
    record = conversation(("user", "hi"), ("assistant", "yo"), ("user", "ok"))
    both, stats = rendered(encoder, record, user_speaker="both", complete=True)
    first, second = (tokens for tokens, _ in both)
    assert first[-len(END) - 4:] == [*ids("ok"), *END, IM_END, NL] and first[6:10] == [*ids("hi"), IM_END, NL]
    # the second speaker's only turn is its last: it left after "yo" (the first speaker said "ok" after it)
    assert second == [*ASSISTANT, *ids("hi"), IM_END, NL, *USER, *ids("yo"), *END, IM_END, NL]
    assert stats.ended == 2


def test_a_window_cut_out_of_a_long_conversation_has_no_marker_where_it_was_cut(encoder):
    # as test_long_conversation_keeps_recent_context_and_whole_targets, complete: window 1 ends at "cccc", unmarked
    record = conversation(
        ("user", "aaaa"), ("assistant", "bbbb"), ("user", "cccc"), ("assistant", "dd"), ("user", "ee")
    )
    (tokens_a, _), (tokens_b, spans_b), *rest = rendered(encoder, record, seq_length=44 + len(END), complete=True)[0]
    assert rest == [] and tokens_a[-6:] == [*ids("cccc"), IM_END, NL] and ids("<")[0] not in tokens_a
    assert tokens_b == [*ASSISTANT, *ids("dd"), IM_END, NL, *USER, *ids("ee"), *END, IM_END, NL]
    assert positions(spans_b) == list(range(21, 21 + 2 + len(END) + 1))


def test_an_overlong_last_turn_is_counted_without_an_end_target(encoder):
    record = conversation(("user", "hi"), ("assistant", "yo"), ("user", "x" * 40))
    samples, stats = rendered(encoder, record, seq_length=30, complete=True)
    assert [s[0] for s in samples] == [[*USER, *ids("hi"), IM_END, NL]]
    assert stats.ended == 0 and stats.not_ended["last_turn_overlong"] == 1


def test_sft_ends_the_utterance_after_the_thought_with_the_marker(encoder):
    record = conversation(("user", "hi", "hm"), ("assistant", "yo"), ("user", "ok", "so"))
    samples, stats = rendered(encoder, record, with_thinking=True, complete=True)
    first, second = samples
    assert first[0] == [*USER, THINK, *ids("\nhm\n"), END_THINK, *ids("\n\nhi"), IM_END, NL]  # not its last turn
    assert second[0][-(len(END) + 12):] == [THINK, *ids("\nso\n"), END_THINK, *ids("\n\nok"), *END, IM_END, NL]
    assert positions(second[1]) == list(range(31, 42 + len(END)))
    assert stats.ended == 1
    # a last turn without a thought is no SFT target, so no end target either
    record = conversation(("user", "hi", "hm"), ("assistant", "yo"), ("user", "ok"))
    _, stats = rendered(encoder, record, with_thinking=True, complete=True)
    assert stats.ended == 0 and stats.not_ended["last_turn_unsupervised"] == 1


@pytest.mark.parametrize(
    ("plain", "target", "is_target", "seq_length", "pinned", "one", "windows", "overlong"),
    [
        # windows advance; context is at most half of the row
        ([10, 15, 10, 15, 10], [10, 0, 10, 0, 10], [1, 0, 1, 0, 1], 30, False, False,
         [[(0, True)], [(1, False), (2, True)], [(3, False), (4, True)]], 0),
        # an overlong target is skipped and breaks the context chain
        ([10, 15, 40, 15, 10], [10, 0, 40, 0, 10], [1, 0, 1, 0, 1], 30, False, False,
         [[(0, True)], [(3, False), (4, True)]], 1),
        # a leading system turn stays when it fits, even when the turns after it do not
        ([5, 10, 15, 10], [0, 10, 0, 10], [0, 1, 0, 1], 28, True, False,
         [[(0, False), (1, True)], [(0, False), (3, True)]], 0),
        # SFT: one target per window, all context that fits
        ([10, 15, 10], [14, 0, 14], [1, 0, 1], 40, False, True,
         [[(0, True)], [(0, False), (1, False), (2, True)]], 0),
    ],
)  # fmt: skip
def test_plan_windows(plain, target, is_target, seq_length, pinned, one, windows, overlong):
    assert plan_windows(plain, target, [bool(f) for f in is_target], seq_length, pinned, one) == (windows, overlong)

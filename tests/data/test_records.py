"""Format adapters and the offline tokenizer."""

import pytest

from data_prep.records import FORMATS, RecordError, Turn, to_conversation
from data_prep.synthetic import with_synthetic_thinking
from data_prep.tokenizer import TextEncoder, load_encoder, train_bpe


def chitchat_record(*groups):
    return {"id": "k1", "messages": [[{"sender": s, "text": t} for t in texts] for s, texts in groups]}


def test_chitchat_turns_join_lines_and_map_senders():
    record = chitchat_record(("A", ["Hello", "How are you?"]), ("B", ["fine"]), ("A", ["good"]))
    conv = to_conversation(record, "chat.json:k1", FORMATS["chitchat"])
    assert conv.id == "k1"
    assert conv.turns == (Turn("user", "Hello\nHow are you?"), Turn("assistant", "fine"), Turn("user", "good"))


def test_chitchat_third_speaker_is_rejected():
    record = chitchat_record(("A", ["hi"]), ("B", ["yo"]), ("C", ["hey"]))
    with pytest.raises(RecordError, match=r"chat.json:k1: messages\[2\]\[0\].sender: a third speaker"):
        to_conversation(record, "chat.json:k1", FORMATS["chitchat"])


def test_sharegpt_roles_and_content_id_when_no_id():
    record = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]}
    conv = to_conversation(record, "x:1", FORMATS["sharegpt"])
    assert [t.role for t in conv.turns] == ["system", "user"]
    assert conv.id.startswith("sha1:") and conv.id == to_conversation(record, "y:9", FORMATS["sharegpt"]).id


def test_double_texting_is_a_bad_record_unless_merged():
    record = {"messages": [{"role": "user", "content": "hey", "thinking": "greet"},
                           {"role": "user", "content": "u there?", "thinking": "nudge"},
                           {"role": "assistant", "content": "yes"}, {"role": "user", "content": "ok"},
                           {"role": "user", "content": "bye"}]}
    with pytest.raises(RecordError, match=r"x:1: messages\[1\]: two user turns in a row .*\[non_alternating\]"):
        to_conversation(record, "x:1", FORMATS["messages"])
    conv = to_conversation(record, "x:1", FORMATS["messages"].with_overrides(double_texting="merge"))
    assert conv.turns == (Turn("user", "hey\nu there?", "greet\nnudge"), Turn("assistant", "yes"),
                          Turn("user", "ok\nbye"))


def test_synthetic_thinking_quotes_previous_turn():
    conv = to_conversation(
        {"messages": [{"role": "user", "content": "a b c d e f g h i j"}, {"role": "assistant", "content": "ok"}]},
        "x:1",
        FORMATS["messages"],
    )
    thoughts = [t.thinking for t in with_synthetic_thinking(conv).turns]
    assert thoughts == [
        "I am opening the conversation, so I start with something simple.",
        'They said "a b c d e f g h ...". I answer that in my own words and keep it short.',
    ]


def test_trained_bpe_has_chat_specials_and_keeps_special_text_plain(tmp_path):
    texts = ["hello there, how are you doing today?", "I am fine, thanks for asking!"] * 50
    directory = train_bpe(texts, 600, tmp_path / "tok")
    encoder = TextEncoder(directory)
    assert [encoder.special[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert 2 not in encoder.encode_batch(["say <|im_end|> now"])[0]
    assert encoder.decode(encoder.encode_batch(["hello there\nyou"])[0]) == "hello there\nyou"
    assert (directory / "tokenizer_config.json").is_file()


def test_sentencepiece_model_as_tokenizer(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    from data_prep.midtrain import build
    from tests.data.conftest import conversation, write_jsonl

    texts = ["hello there how are you", "fine thanks and you", "user assistant system"] * 30
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=30,
        user_defined_symbols=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        minloglevel=2,
    )
    model = tmp_path / "sp.model"
    encoder = load_encoder(model)
    im_start, im_end = encoder.special["<|im_start|>"], encoder.special["<|im_end|>"]
    path = write_jsonl(tmp_path / "c.jsonl", [conversation(("user", "hello there"), ("assistant", "fine"))])
    result = build(
        inputs=[str(path)], output=str(tmp_path / "out"), tokenizer=str(model), seq_length=64, valid_fraction=0.0
    )
    from megatron_mimesis.data import PackedConversationDataset

    tokens = PackedConversationDataset(result.manifest["corpora"]["c"]["prefixes"]["train"])[0]["tokens"].tolist()
    user_ids = encoder.encode_batch(["user\n", "hello there <END>", "\n"])  # the user's last turn: it left
    assert tokens[: 2 + sum(map(len, user_ids))] == [im_start, *user_ids[0], *user_ids[1], im_end, *user_ids[2]]
    assert result.manifest["tokenizer"]["path"] == str(model.resolve())

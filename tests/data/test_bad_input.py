"""Each kind of bad record: a message naming file, line and field; fail stops, skip counts by reason."""

import json

import pytest

from data_prep.cli import main
from data_prep.midtrain import build
from data_prep.pipeline import PrepError
from tests.data.conftest import conversation, write_jsonl

GOOD = conversation(("user", "hi"), ("assistant", "yo"))

BAD_RECORDS = [
    # (line, reason, message fragment)
    (b'{"messages": [', "malformed_json", ":2: <line>: malformed JSON"),
    (b'{"messages": [{"role": "user", "content": "caf\xff"}]}', "invalid_utf8", ":2: <line>: invalid UTF-8 at byte 46"),
    (json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode(), "invalid_utf8", ":2: messages[0].content"),
    (json.dumps({"messages": "hi"}).encode(), "wrong_type", ":2: messages: expected list, got str"),
    (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "wrong_type", ":2: messages[0].content: expected str"),
    (json.dumps([1]).encode(), "wrong_type", ":2: <record>: expected an object"),
    (json.dumps(conversation(("bot", "hi"))).encode(), "unknown_role", ":2: messages[0].role: unknown role 'bot'"),
    (json.dumps(conversation(("user", "  "))).encode(), "empty_content", ":2: messages[0].content: empty"),
    (json.dumps(conversation(("user", "a"), ("user", "b"))).encode(), "non_alternating", ":2: messages[1]: two user turns"),
    (json.dumps(conversation(("user", "a"), ("system", "b"))).encode(), "non_alternating", ":2: messages[1]: system turn"),
    (json.dumps({"msgs": []}).encode(), "missing_field", ":2: messages: missing"),
]  # fmt: skip


def corpus(tmp_path, bad_line):
    return str(write_jsonl(tmp_path / "corpus.jsonl", [GOOD, bad_line, GOOD]))


@pytest.mark.parametrize(
    ("line", "reason", "message"), BAD_RECORDS, ids=[r[1] + str(i) for i, r in enumerate(BAD_RECORDS)]
)
def test_fail_names_file_line_and_field(tmp_path, char_tokenizer_dir, line, reason, message):
    path = corpus(tmp_path, line)
    with pytest.raises(PrepError) as err:
        build(inputs=[path], output=str(tmp_path / "out"), tokenizer=str(char_tokenizer_dir), seq_length=64)
    assert f"{path}{message}" in str(err.value) and f"[{reason}]" in str(err.value)
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize(
    ("line", "reason", "message"), BAD_RECORDS, ids=[r[1] + str(i) for i, r in enumerate(BAD_RECORDS)]
)
def test_skip_counts_by_reason(tmp_path, char_tokenizer_dir, line, reason, message):
    result = build(
        inputs=[corpus(tmp_path, line)],
        output=str(tmp_path / "out"),
        tokenizer=str(char_tokenizer_dir),
        seq_length=64,
        on_error="skip",
    )
    manifest = result.manifest["corpora"]["corpus"]
    assert manifest["documents_in"] == 3 and manifest["conversations"] == 2
    assert manifest["skipped"] == {reason: 1}
    assert sum(manifest["samples_out"].values()) == 2


def test_missing_field_of_a_column_mapping(tmp_path, char_tokenizer_dir):
    path = str(
        write_jsonl(tmp_path / "mapped.jsonl", [{"turns": [{"speaker": "user", "text": "hi"}, {"speaker": "user"}]}])
    )
    with pytest.raises(PrepError, match=r"mapped.jsonl:1: turns\[0\].content: missing"):
        build(
            inputs=[path],
            output=str(tmp_path / "a"),
            tokenizer=str(char_tokenizer_dir),
            messages_field="turns",
            role_field="speaker",
        )
    with pytest.raises(PrepError, match=r"mapped.jsonl:1: turns\[1\].text: missing"):
        build(
            inputs=[path],
            output=str(tmp_path / "b"),
            tokenizer=str(char_tokenizer_dir),
            messages_field="turns",
            role_field="speaker",
            content_field="text",
        )


def test_cli_exits_nonzero_with_one_line(tmp_path, char_tokenizer_dir, capsys):
    path = corpus(tmp_path, b"{not json")
    code = main(
        "midtrain", ["--input", path, "--output", str(tmp_path / "out"), "--tokenizer", str(char_tokenizer_dir)]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: {path}:2: <line>: malformed JSON") and err.count("\n") == 1


def test_cli_yaml_config_with_flag_override_and_summary(tmp_path, char_tokenizer_dir, capsys):
    path = write_jsonl(tmp_path / "corpus.jsonl", [GOOD, GOOD])
    config = tmp_path / "prep.yaml"
    config.write_text(f"inputs: [{path}]\ntokenizer: {char_tokenizer_dir}\nseq_length: 64\nvalid_fraction: 0.0\n")
    assert main("midtrain", ["--config", str(config), "--seq-length", "32", "--output", str(tmp_path / "out")]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["seq_length"] == 32 and manifest["corpora"]["corpus"]["samples_out"]["train"] == 2
    assert "corpus" in capsys.readouterr().out
    config.write_text("seq_lenght: 64\n")
    assert main("midtrain", ["--config", str(config)]) == 1
    assert "unknown options ['seq_lenght']" in capsys.readouterr().err

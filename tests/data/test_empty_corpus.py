"""A build that would hand the trainer nothing is an error with the counts; a tokenizer smaller than asked is a
warning with both numbers (issue 15, item 7)."""

import json

import pytest

from data_prep.cli import main
from data_prep.midtrain import build
from data_prep.pipeline import SmallVocabWarning
from tests.data.conftest import conversation, write_jsonl


def _prep(tmp_path, path, *flags):
    return main("midtrain", ["--input", str(path), "--output", str(tmp_path / "out"), "--seq-length", "64", *flags])


def test_an_empty_corpus_is_an_error(tmp_path, char_tokenizer_dir, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert _prep(tmp_path, tmp_path / "empty.jsonl", "--tokenizer", str(char_tokenizer_dir)) == 1
    assert capsys.readouterr().err == ("error: empty: no training samples from 0 records (skipped: none; "
                                       "dropped: none)\n")
    assert not (tmp_path / "out" / "manifest.json").exists()  # nothing the trainer would take for a dataset


def test_a_corpus_whose_records_are_all_skipped_is_an_error_with_the_counts(tmp_path, char_tokenizer_dir, capsys):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"msgs": []}, conversation(("user", " ")), {"msgs": []},
                                                conversation(("assistant", "only the assistant speaks"))])
    assert _prep(tmp_path, path, "--tokenizer", str(char_tokenizer_dir), "--on-error", "skip") == 1
    assert capsys.readouterr().err == ("error: bad: no training samples from 4 records (skipped: 1 empty_content, "
                                       "2 missing_field; dropped: 1 no_target_turn)\n")


def test_a_trained_tokenizer_smaller_than_asked_is_a_warning_with_both_numbers(tmp_path, capsys):
    path = write_jsonl(tmp_path / "small.jsonl", [conversation(("user", "hi there"), ("assistant", "hello"))] * 20)
    assert _prep(tmp_path, path, "--vocab-size", "600", "--valid-fraction", "0") == 0
    vocab = json.loads((tmp_path / "out" / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    assert vocab < 600
    assert capsys.readouterr().err.endswith(f"warning: the tokenizer trained on the corpus has {vocab} tokens, fewer "
                                            f"than the 600 of --vocab-size: the corpus has no more distinct merges "
                                            f"to learn\n")
    with pytest.warns(SmallVocabWarning, match=f"has {vocab} tokens, fewer than the 600"):  # also when reused
        assert build(inputs=[str(path)], output=str(tmp_path / "out"), seq_length=64, vocab_size=600,
                     valid_fraction=0.0).reused

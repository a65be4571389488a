"""eval_simulator on a user's own chat logs: real human conversations as a chat app records them, one message per
send, so one speaker often sends several in a row (double-texting) and some messages are empty.

The logs are the chit-chat corpus (a third-party corpus of real human-human chats) written out message by message,
10 of its conversations, two of which hold an empty message. ``--double-texting merge --on-error skip`` must score
exactly what a run on the cleaned file scores (the cleaning done here in plain Python: runs of one speaker joined by
a newline, the conversations with an empty message dropped) and count the two it skipped by reason; a data_prep
manifest of the same logs restricts the evaluation to its held-out split, and flags the training conversations of
an input that overlaps it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.eval.test_cli import eval_simulator
from tests.rl.fakes import FakeOpenAIServer

REPO = Path(__file__).resolve().parents[2]
STRETCHES = ((571, 576), (601, 606))  # two stretches of the corpus, each with one conversation with an empty message
COUNT = sum(stop - start for start, stop in STRETCHES)


def _chitchat() -> list[tuple[str, list[tuple[str, str]]]]:
    """(id, [(sender, text), ...] one per message sent) of the conversations of :data:`STRETCHES`, in corpus order."""
    import chitchat_dataset

    corpus = json.loads(Path(chitchat_dataset.__file__).with_name("dataset.json").read_text())
    keys = [key for start, stop in STRETCHES for key in list(corpus)[start:stop]]
    return [(key, [(u["sender"], u["text"]) for group in corpus[key]["messages"] for u in group]) for key in keys]


def _as_log(conversation: tuple[str, list[tuple[str, str]]]) -> dict:
    key, messages = conversation
    first = messages[0][0]
    return {"id": key, "messages": [{"role": "user" if sender == first else "assistant", "content": text}
                                    for sender, text in messages]}


def _cleaned(log: dict) -> dict | None:
    """The record with each run of one speaker's messages joined, or None if it has an empty message."""
    if any(not m["content"].strip() for m in log["messages"]):
        return None
    merged = []
    for m in log["messages"]:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n" + m["content"]}
        else:
            merged.append(dict(m))
    return {"id": log["id"], "messages": merged}


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    work = tmp_path_factory.mktemp("own-logs")
    records = [_as_log(c) for c in _chitchat()]
    cleaned = [c for c in map(_cleaned, records) if c is not None]
    assert sum(any(m["role"] == n["role"] for m, n in zip(r["messages"], r["messages"][1:], strict=False))
               for r in records) > COUNT // 2  # double-texting is the rule in these logs, not the exception
    assert len(cleaned) == COUNT - 2
    return _write(work / "logs.jsonl", records), _write(work / "cleaned.jsonl", cleaned)


def _evaluate(tmp_path, name, simulator: list[str], *flags, expect=0):
    out = tmp_path / name
    code = eval_simulator.main([*simulator, "--seq-length", "256", "--max-new-tokens", "2", "--bootstrap", "20",
                                "--output", str(out), "--no-progress", *flags])
    assert code == expect
    return (json.loads((out / "results.json").read_text()), (out / "items.jsonl").read_text(),
            (out / "table.md").read_text()) if code == 0 else None


def _figures(results: dict) -> dict:
    return {k: results[k] for k in ("positions", "renderings", "conversations", "cells", "counts")}


def test_double_texting_merged_and_bad_records_skipped_score_as_the_cleaned_file(logs, tiny_hf_checkpoint,
                                                                                  tiny_dataset, tmp_path, capsys):
    raw, cleaned = logs
    tiny = ["--simulator", f"tiny=hf:{tiny_hf_checkpoint}", "--tokenizer", str(tiny_dataset / "tokenizer")]
    as_given = _evaluate(tmp_path, "raw", tiny, "--input", str(raw), "--double-texting", "merge", "--on-error", "skip")
    reference = _evaluate(tmp_path, "clean", tiny, "--input", str(cleaned))
    results, items, table = as_given
    assert results["skipped_records"] == {"empty_content": 2}
    assert reference[0]["skipped_records"] == {}
    assert _figures(results) == _figures(reference[0]) and items == reference[1]
    assert results["conversations"] == COUNT - 2 and results["positions"] > 50
    assert results["counts"]["tiny"]["likelihood_tokens"] > 0
    assert "2 bad input records skipped (empty_content: 2)" in table
    print(f"MEASURED own logs: {results['conversations']} conversations, {results['positions']} positions scored, "
          f"skipped {results['skipped_records']}; NLL/token {results['cells']['tiny']['nll_per_token']['value']:.4f}"
          " on both files")

    # without the rules the first double-text stops the run, naming where; with them off but skipping, every
    # conversation with a double-text is counted as non_alternating
    capsys.readouterr()
    _evaluate(tmp_path, "strict", tiny, "--input", str(raw), expect=2)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {raw}:") and "turns in a row" in err and "--on-error skip" in err, err
    assert len(err.splitlines()) == 1


def test_a_manifest_scores_its_held_out_split_and_flags_training_overlap(logs, tiny_dataset, tmp_path, capsys):
    """The simulator here is a chat endpoint (a scripted one): what is under test is which conversations are read."""
    raw, _ = logs
    tokenizer = tiny_dataset / "tokenizer"
    built = subprocess.run([sys.executable, "-m", "data_prep.midtrain", "--input", str(raw), "--double-texting",
                            "merge", "--on-error", "skip", "--valid-fraction", "0.2", "--seq-length", "256",
                            "--tokenizer", str(tokenizer), "--output", str(tmp_path / "data")],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    manifest = tmp_path / "data" / "manifest.json"
    corpus = json.loads(manifest.read_text())["corpora"]["logs"]
    assert corpus["record_format"]["double_texting"] == "merge" and corpus["on_error"] == "skip"

    with FakeOpenAIServer() as server:
        chat = ["--simulator", f"chat=openai:{server.base_url}@sim"]
        held_out = _evaluate(tmp_path, "manifest", chat, "--manifest", str(manifest))[0]
        same = _evaluate(tmp_path, "flags", chat, "--input", str(raw), "--double-texting", "merge", "--on-error",
                         "skip", "--valid-fraction", "0.2")[0]
        capsys.readouterr()
        results, _, table = _evaluate(tmp_path, "overlap", chat, "--input", str(raw), "--double-texting", "merge",
                                      "--on-error", "skip", "--manifest", str(manifest))
        _evaluate(tmp_path, "conflict", chat, "--manifest", str(manifest), "--format", "sharegpt", expect=2)
    assert _figures(held_out) == _figures(same)
    assert 0 < held_out["conversations"] < COUNT - 2 and held_out["training_overlap"] is None

    trained_on = COUNT - 2 - held_out["conversations"]
    assert results["training_overlap"] == trained_on
    warning = (f"warning: {trained_on} of the {COUNT - 2} conversations scored are in the training split of "
               f"--manifest {manifest}")
    err = capsys.readouterr().err
    assert warning in err and warning in table
    assert "error: --format: --manifest reads its corpora as they were built" in err


def test_help_shows_every_default_and_the_input_formats(capsys):
    with pytest.raises(SystemExit):
        eval_simulator.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("(default: messages)", "(default: reject)", "(default: 24576)", "(default: 1.0)", "(default: 0)",
                  "(default: 50)", '{"from": "human"', '[{"sender": "ann"', "(default: 1000)"):
        assert shown in text, shown

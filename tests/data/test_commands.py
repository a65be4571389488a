"""The README's data_prep commands as a user types them, in their smallest real form: ``python -m data_prep.sft``
on a thinking-format file, and ``python -m data_prep.bench``, whose figures go to ``runs/`` (never the checkout)."""

import json
import subprocess
import sys

from tests.data.conftest import write_jsonl


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_sft_builds_thinking_targets_from_a_file(char_tokenizer_dir, tmp_path):
    records = [{"messages": [{"role": "assistant", "content": "how can i help"},
                             {"role": "user", "content": "i need a flight", "thinking": "ask plainly"},
                             {"role": "assistant", "content": "where to"},
                             {"role": "user", "content": "to rome", "thinking": "be brief"}]}] * 3
    write_jsonl(tmp_path / "thoughttrace.jsonl", records)
    done = _run("data_prep.sft", "--input", "thoughttrace.jsonl", "--output", "sft", "--tokenizer",
                str(char_tokenizer_dir), "--seq-length", "128", "--valid-fraction", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((tmp_path / "sft" / "manifest.json").read_text())
    corpus = manifest["corpora"]["thoughttrace"]
    assert manifest["task"] == "sft" and corpus["documents_in"] == 3
    assert corpus["samples_out"]["train"] == 6  # one sample per thought
    assert "sft -> sft" in done.stdout
    # a messages file is whole conversations unless told: each one's last thought-supervised turn ends it
    assert corpus["complete"] and corpus["end_targets"]["ended"] == 3 and "3 / 3" in done.stdout
    wrong = _run("data_prep.sft", "--input", "thoughttrace.jsonl", "--complete", "maybe", cwd=tmp_path)
    assert wrong.returncode == 2 and "--complete: expected yes or no, got 'maybe'" in wrong.stderr


def test_bench_prints_and_writes_its_rates(tiny_dataset, tmp_path, checkout_untouched):
    done = _run("data_prep.bench", "--max-conversations", "20", "--workers", "1", "--repeats", "1", "--tokenizer",
                str(tiny_dataset / "tokenizer"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("raw encode_batch -> ids, 1 thread: ") and "tokens/CPU-s" in lines[0]
    assert lines[2].startswith("pipeline, 1 worker(s): ") and "x raw" in lines[2]
    results = json.loads((tmp_path / "runs" / "bench-data-prep" / "bench_data_prep.json").read_text())
    assert results["raw"]["tokens"] > 0 and results["max_conversations"] == 20
    (pipeline,) = results["pipeline"]
    assert pipeline["workers"] == 1 and pipeline["tokens_per_s"] > 0
    assert pipeline["vs_raw"] == pipeline["tokens_per_s"] / results["raw"]["tokens_per_s"]

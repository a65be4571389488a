"""The held-out NLL is the trainer's validation loss: same rows, same targets, same number."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from megatron_mimesis.eval import report
from tests.training.conftest import SEQ_LENGTH, common_args, read_metrics, run_trainer

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "eval_simulator.py"
_spec = importlib.util.spec_from_file_location("eval_simulator", SCRIPT)
eval_simulator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_simulator)


def test_nll_equals_the_trainers_validation_loss_on_the_same_rows(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    corpus = json.loads((tiny_dataset / "chitchat" / "manifest.json").read_text())
    valid_rows = corpus["rows"]["valid"]
    # one step, then the trainer's own evaluation over every valid row exactly once (one epoch of the valid split)
    run_trainer(1, *common_args(tiny_dataset, tmp_path / "run", "--pretrained-hf", str(tiny_hf_checkpoint),
                                "--train-iters", "1", "--lr-warmup-iters", "0", "--global-batch-size", "1",
                                "--eval-interval", "1", "--eval-iters", str(valid_rows), "--save", str(tmp_path / "ckpt")))
    valid_loss = next(r["loss"] for r in read_metrics(tmp_path / "run") if r.get("split") == "valid")

    out = tmp_path / "eval"
    # the dataset is the embedded corpus's first 300 records; its valid split is what the evaluation holds out
    code = eval_simulator.main(["--simulator", f"trained=ckpt:{tmp_path / 'ckpt'}", "--max-conversations", "300",
                                "--seq-length", str(SEQ_LENGTH), "--max-new-tokens", "1", "--bootstrap", "20",
                                "--output", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    cells = results["cells"]["trained"]
    assert cells["nll_per_token"]["value"] == pytest.approx(valid_loss, abs=2e-5)
    # exactly the trainer's targets: as many loss tokens as the valid rows hold
    assert results["counts"]["trained"]["likelihood_tokens"] == corpus["loss_tokens"]["valid"]
    assert cells["nll_per_token"]["low"] <= cells["nll_per_token"]["value"] <= cells["nll_per_token"]["high"]
    assert cells["bits_per_byte"]["value"] > 0

    assert {p.name for p in out.iterdir()} == {"results.json", "table.csv", "table.md", "items.jsonl",
                                               "lengths.png", "metrics.png", "cache.jsonl"}
    assert (out / "lengths.png").read_bytes()[:4] == b"\x89PNG"
    rows = {(r["row"], r["metric"]): r for r in csv.DictReader((out / "table.csv").open())}
    assert float(rows["trained", "nll_per_token"]["value"]) == pytest.approx(valid_loss, abs=2e-5)
    assert rows["human", "nll_per_token"]["value"] == ""
    lines = (out / "table.md").read_text().splitlines()
    assert lines[lines.index("### " + report.GROUP_TITLES["likelihood"]) + 2] == "| | NLL/token | bits/byte |"

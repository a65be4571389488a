"""The benchmark's CPU mode end to end on one tiny shape (rows, error columns, failure rows, output files), and the
documented command in its smallest form."""

import json
import subprocess
import sys

import torch
from megatron_mimesis.kernels import bench


def _broken_provider(hidden, weight, x, seq_len):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 61.00 GiB")


def test_small_bench_writes_table_csv_json_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "small_shapes", lambda: [bench.Shape(32, 70, 16, 16)])
    monkeypatch.setitem(bench.PROVIDERS, "broken", _broken_provider)
    rows = bench.run(small=True, output=tmp_path, providers=["torch-eager", "ours", "broken"], reps=1)
    by_name = {row.provider: row for row in rows}
    assert by_name["torch-eager"].status == "ok" and by_name["ours"].status == "ok"
    assert by_name["broken"].status.startswith("failed: OutOfMemoryError")
    # ours keeps fp32 logits: per-token log-probs within 1e-5 of the fp32 reference, gradients aligned
    assert by_name["ours"].logprob_max_abs < 1e-5 and by_name["ours"].grad_h_cos > 0.9999
    assert "provider" in capsys.readouterr().out
    saved = json.loads((tmp_path / "policy_loss_small.json").read_text())
    assert [r["provider"] for r in saved["rows"]] == ["torch-eager", "ours", "broken"]
    assert len((tmp_path / bench.CSV_NAME).read_text().splitlines()) == 4  # header + 3 rows
    assert (tmp_path / "policy_loss_small.png").stat().st_size > 0


def test_the_documented_command_writes_its_output_only_and_prints_the_reference(tmp_path, checkout_untouched):
    """``python -m megatron_mimesis.kernels.bench --small`` (what ``make bench`` runs here), one provider: its files
    land in ``runs/bench-kernels`` of the working directory, and the committed reference is printed beside it."""
    done = subprocess.run([sys.executable, "-m", "megatron_mimesis.kernels.bench", "--small", "--providers",
                           "torch-eager", "--reps", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "runs" / "bench-kernels"
    assert sorted(p.name for p in out.iterdir()) == [bench.CSV_NAME, "policy_loss_small.json", "policy_loss_small.png"]
    saved = json.loads((out / "policy_loss_small.json").read_text())
    assert [(r["provider"], r["num_tokens"], r["status"]) for r in saved["rows"]] == [
        ("torch-eager", s.num_tokens, "ok") for s in bench.small_shapes()]
    assert saved["env"]["command"].endswith("--small --providers torch-eager --reps 1") and saved["env"]["machine"]
    reference = json.loads(bench.reference_path("small").read_text())
    assert f"beside the reference run {bench.reference_path('small')}" in done.stdout
    theirs = next(r for r in reference["rows"] if r["provider"] == "torch-eager" and r["num_tokens"] == 64)
    beside = next(line for line in done.stdout.splitlines()[::-1] if line.startswith("torch-eager") and " 64 " in line)
    assert f"{theirs['fwd_bwd_ms']:10.2f}" in beside and f"{theirs['grad_h_max_abs']:10.1e}" in beside

"""The benchmark's CPU mode end to end on one tiny shape: rows, error columns, failure rows and output files."""

import json

import torch
from megatron_mimesis.kernels import bench


def _broken_provider(hidden, weight, x, seq_len):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 61.00 GiB")


def test_small_bench_writes_table_csv_json_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "small_shapes", lambda: [bench.Shape(32, 70, 16, 16)])
    monkeypatch.setitem(bench.PROVIDERS, "broken", _broken_provider)
    rows = bench.run(small=True, out_dir=tmp_path, providers=["torch-eager", "ours", "broken"], reps=1)
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

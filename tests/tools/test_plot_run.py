import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "plot_run.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plots_train_and_valid(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    train = [
        {"iteration": i, "loss": 8.0 - 0.1 * i, "lr": 1e-3, "grad_norm": None, "tokens_per_sec": 900.0 + i, "mfu": None}
        for i in range(1, 21)
    ]
    valid = [{"iteration": 10, "split": "valid", "loss": 7.2}, {"iteration": 20, "split": "valid", "loss": 6.5}]
    write_records(metrics, train + valid)
    out = tmp_path / "plots" / "loss.png"
    result = run(metrics, "-o", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_output_next_to_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_records(metrics, [{"iteration": 1, "loss": 5.0, "tokens_per_sec": None}])
    assert run(metrics).returncode == 0
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_malformed_line_reported_with_number(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 1, "loss": 5.0}\n{"iteration": 2, "loss": \n')
    result = run(metrics)
    assert result.returncode == 1
    assert "malformed line 2" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_and_empty(tmp_path):
    result = run(tmp_path / "nope.jsonl")
    assert result.returncode == 1 and "no such file" in result.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = run(empty)
    assert result.returncode == 1 and "no records" in result.stderr

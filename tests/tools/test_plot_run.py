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


def test_summary_line_is_the_first_and_last_ten_step_means(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rewards = [0.05 * i for i in range(14)]  # 14 steps: the two windows overlap
    write_records(metrics, [{"iteration": i, "reward_mean": r, "rollout_time_s": 1.0} for i, r in enumerate(rewards)])
    result = run(metrics, "--metric", "reward_mean", "--speed", "rollout_time_s", "--summary")
    assert result.returncode == 0, result.stderr
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert result.stdout.splitlines() == [
        str(tmp_path / "loss.png"),
        f"reward_mean {first:.3f} over the first 10 steps, {last:.3f} over the last 10 (14 steps)"]
    result = run(metrics, "--summary")  # no train record has a loss
    assert result.returncode == 1 and result.stderr.strip() == "error: no train record has a 'loss' value"

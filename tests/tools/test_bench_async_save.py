"""``python tools/bench/bench_async_save.py`` in its smallest form (the tiny model on 2 ranks): a row per way and rank with
its blocking time, bytes written and peak memory, and a JSON report; the checkpoints are removed once measured."""

import json
import os
import subprocess
import sys

import pytest

from tests.training.conftest import REPO


@pytest.mark.slow
def test_the_smallest_run_reports_each_way_and_rank(tmp_path, checkout_untouched):
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_async_save.py"), "--hidden", "64", "--ffn",
                           "128", "--vocab", "512", "--output", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()[-6:]]
    assert [(r[0], r[1]) for r in rows] == [(way, rank) for way in ("sync", "async", "parallel") for rank in "01"]
    report = json.loads((tmp_path / "out" / "bench_async_save.json").read_text())
    ways = report["ways"]
    total = sum(r["optimizer_bytes"] for r in ways["sync"])
    assert total > 12 * report["parameters"]  # fp32 weights and Adam's moments, plus DCP's framing of each chunk
    assert [r["optimizer_bytes"] for r in ways["sync"]] == [total, 0]  # fully_reshardable: DP rank 0 writes it all
    assert all(0.4 * total < r["optimizer_bytes"] < 0.6 * total for r in ways["parallel"])
    assert all(r["blocked_s"] > 0 and r["written_s"] >= r["blocked_s"] for rows in ways.values() for r in rows)
    assert not (tmp_path / "out" / "checkpoints").exists()

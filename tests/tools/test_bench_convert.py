"""``python tools/bench/bench_convert.py`` in its smallest form (the tiny preset, one depth): it runs the conversion CLIs,
prints their wall time and peak RSS per GiB of checkpoint with the round trip's verdict, and writes its JSON under
``runs/``. The 4B / 9B runs themselves are benchmarks, not tests (docs/development.md, Benchmarks)."""

import json
import subprocess
import sys

import pytest

from tests.training.conftest import REPO


@pytest.mark.slow
def test_the_smallest_run_reports_rss_per_checkpoint_gib_and_a_bit_exact_round_trip(tmp_path, checkout_untouched):
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_convert.py"), "--preset", "tiny", "--layers",
                           "4", "--workdir", str(tmp_path / "work")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    header, row = done.stdout.splitlines()[-3:-1]
    assert header.split() == ["layers", "params", "ckpt", "GiB", "import", "s", "RSS", "GiB", "/ckpt", "export", "s",
                              "RSS", "GiB", "/ckpt", "round", "trip"]
    assert row.split()[0] == "4" and row.endswith("bit-exact")
    results = json.loads((tmp_path / "runs" / "bench-convert" / "bench_convert.json").read_text())
    (run,) = results["runs"]
    assert results["preset"] == "tiny" and run["round_trip_bit_exact"] and results["import_slope"] is None
    for phase in ("import", "export"):
        assert run[phase]["peak_rss_gib"] > 0
        assert run[phase]["rss_per_checkpoint_gib"] == pytest.approx(run[phase]["peak_rss_gib"] / run["checkpoint_gib"],
                                                                     rel=0.05)
    assert not any((tmp_path / "work").iterdir())  # the checkpoints are removed once measured

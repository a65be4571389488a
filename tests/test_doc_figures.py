"""Figures quoted in the docs, the launch files and their comments come from one place, so two of them cannot disagree.

A quoted figure is marked where it stands: ``116.8<!--fig:9b.checkpoint_gib--> GiB`` (an HTML comment: invisible in
rendered markdown, plain text in a YAML or shell comment). Every quote of one key must be the same figure; a key
whose figure a tool of the project computes (:data:`DERIVED`) must be that tool's figure, so a change to the model,
the layout or the optimizer that moves it fails here until every quote follows. Measured figures (a build's minutes,
an environment's size) have no tool to ask: their quotes must agree with each other."""

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"(~?[\d.,]+)<!--fig:([a-z0-9_.]+)-->")
QUOTING = ("README.md", "docs/**/*.md", "launch/**/*.yaml", "launch/**/*.sh", "launch/**/*.sbatch")
PAPER_MFU = 0.122  # the paper's 4.8 days for 9.51B tokens on 32 A100s (docs/layouts.md)


def quotes(files) -> dict[str, set[str]]:
    """key -> the figures quoted for it, as written ("~" and thousands separators dropped)."""
    found = defaultdict(set)
    for path in files:
        for figure, key in MARK.findall(Path(path).read_text()):
            found[key].add(figure.lstrip("~").replace(",", ""))
    return dict(found)


def _plan_checkpoint_gib(config: str) -> str:
    out = subprocess.run([sys.executable, "tools/plan.py", "--config", config], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (gib,) = re.findall(r"^checkpoint \(weights[^)]*\)\s+([\d.]+)", out.stdout, re.MULTILINE)
    return f"{float(gib):.1f}"


def _midtrain_step_s(mfu: float) -> str:
    """A 9B mid-training step at ``mfu`` on the paper's 32 A100s, from the FLOPs the trainer's MFU counts."""
    import yaml

    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.training.flops import PEAK_BF16_FLOPS, train_flops_per_token

    config = yaml.safe_load((REPO / "launch/configs/midtrain_9b.yaml").read_text())
    tokens = config["global_batch_size"] * config["seq_length"]
    flops = train_flops_per_token(get_preset("9b"), config["seq_length"]) * tokens
    return f"{flops / (mfu * PEAK_BF16_FLOPS['A100'] * 32):.0f}"


DERIVED = {
    "9b.checkpoint_gib": lambda: _plan_checkpoint_gib("launch/configs/midtrain_9b.yaml"),
    "4b.checkpoint_gib": lambda: _plan_checkpoint_gib("launch/configs/midtrain_4b.yaml"),
    "9b.midtrain_step_s_40pct": lambda: _midtrain_step_s(0.40),
    "9b.midtrain_step_s_paper": lambda: _midtrain_step_s(PAPER_MFU),
}


@pytest.fixture(scope="module")
def quoted() -> dict[str, set[str]]:
    return quotes(sorted({p for pattern in QUOTING for p in REPO.glob(pattern)}))


def test_every_key_is_quoted_as_one_figure(quoted):
    assert len(quoted) >= len(DERIVED)
    disagreeing = {key: figures for key, figures in quoted.items() if len(figures) > 1}
    assert not disagreeing, disagreeing


@pytest.mark.parametrize("key", sorted(DERIVED))
def test_a_derived_figure_is_the_tools(quoted, key):
    assert quoted.get(key) == {DERIVED[key]()}, (key, quoted.get(key))


def test_two_docs_quoting_different_figures_for_one_measurement_are_caught(tmp_path):
    (tmp_path / "a.md").write_text("a checkpoint of 116.8<!--fig:9b.checkpoint_gib--> GiB, a step of ~26<!--fig:s-->")
    (tmp_path / "b.yaml").write_text("# 2 x 117<!--fig:9b.checkpoint_gib--> GiB; 1,200<!--fig:n--> steps")
    found = quotes([tmp_path / "a.md", tmp_path / "b.yaml"])
    assert found == {"9b.checkpoint_gib": {"116.8", "117"}, "s": {"26"}, "n": {"1200"}}

"""Figures quoted in the docs, the launch files and their comments come from one place, so two of them cannot disagree.

A quoted figure is marked where it stands: ``116.8<!--fig:9b.checkpoint_gib--> GiB`` (an HTML comment: invisible in
rendered markdown, plain text in a YAML or shell comment). Every quote of one key must be the same figure; a key
whose figure a tool of the project computes (:data:`DERIVED`) must be that tool's figure, so a change to the model,
the layout or the optimizer that moves it fails here until every quote follows. Measured figures (a build's minutes,
an environment's size) have no tool to ask: their quotes must agree with each other."""

import functools
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
PAPER_TOKENS, PAPER_GPUS = 9.51e9, 32  # the paper's mid-training: seen tokens, 4 nodes x 8 A100


def quotes(files) -> dict[str, set[str]]:
    """key -> the figures quoted for it, as written ("~" and thousands separators dropped)."""
    found = defaultdict(set)
    for path in files:
        for figure, key in MARK.findall(Path(path).read_text()):
            found[key].add(figure.lstrip("~").replace(",", ""))
    return dict(found)


@functools.cache
def _plan(config: str, *flags: str) -> dict[str, float]:
    """The figures of ``mimesis-plan``'s table for ``config`` (with a stage's ``flags``), by row name."""
    out = subprocess.run([sys.executable, "tools/plan.py", "--config", config, *flags], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return {name.strip(): float(value) for name, value in
            re.findall(r"^(checkpoint.*?)\s{2,}([\d.]+)(?: s)?\s+(?:exact|planned)", out.stdout, re.MULTILINE)}


def _plan_row(config: str, row: str, digits: int, *flags: str) -> str:
    (value,) = [v for name, v in _plan(config, *flags).items() if name.startswith(row)]
    return f"{value:.{digits}f}"


@functools.cache
def _config(path: str) -> dict:
    import yaml

    return yaml.safe_load((REPO / path).read_text())


def _midtrain(path: str) -> tuple[int, float]:
    """Tokens per step and training FLOPs per step of a mid-training config."""
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.training.flops import train_flops_per_token

    config = _config(path)
    tokens = config["global_batch_size"] * config["seq_length"]
    return tokens, train_flops_per_token(get_preset(config["model"]), config["seq_length"]) * tokens


def _midtrain_step_s(config: str, mfu: float) -> float:
    """A mid-training step at ``mfu`` on the paper's 32 A100s, from the FLOPs the trainer's MFU counts."""
    from megatron_mimesis.training.flops import PEAK_BF16_FLOPS

    return _midtrain(config)[1] / (mfu * PEAK_BF16_FLOPS["A100"] * PAPER_GPUS)


def _midtrain_steps(config: str) -> str:
    """The paper's seen tokens over a step's tokens, which is the config's own ``train_iters``."""
    steps = round(PAPER_TOKENS / _midtrain(config)[0])
    assert _config(config)["train_iters"] == steps, config
    return str(steps)


MIDTRAIN_9B, MIDTRAIN_4B = "launch/configs/midtrain_9b.yaml", "launch/configs/midtrain_4b.yaml"
DERIVED = {
    "9b.checkpoint_gib": lambda: _plan_row(MIDTRAIN_9B, "checkpoint (weights", 1),
    "4b.checkpoint_gib": lambda: _plan_row(MIDTRAIN_4B, "checkpoint (weights", 1),
    "9b.trained_mtp_checkpoint_gib": lambda: _plan_row(MIDTRAIN_9B, "checkpoint (weights", 1,
                                                       "--mtp-loss-scaling-factor", "0.1"),
    "9b.checkpoint_node_share_gib": lambda: _plan_row(MIDTRAIN_9B, "checkpoint share", 0),
    "9b.checkpoint_write_s": lambda: _plan_row(MIDTRAIN_9B, "checkpoint write", 0),
    "9b.midtrain_step_s_40pct": lambda: f"{_midtrain_step_s(MIDTRAIN_9B, 0.40):.0f}",
    "9b.midtrain_step_s_paper": lambda: f"{_midtrain_step_s(MIDTRAIN_9B, PAPER_MFU):.0f}",
    "4b.midtrain_step_s_40pct": lambda: f"{_midtrain_step_s(MIDTRAIN_4B, 0.40):.0f}",
    "4b.midtrain_step_s_paper": lambda: f"{_midtrain_step_s(MIDTRAIN_4B, PAPER_MFU):.0f}",
    "9b.midtrain_run_h_40pct": lambda: f"{_midtrain_step_s(MIDTRAIN_9B, 0.40) * int(_midtrain_steps(MIDTRAIN_9B)) / 3600:.0f}",
    "midtrain.tokens_per_step": lambda: str(_midtrain(MIDTRAIN_9B)[0]),
    "midtrain.steps": lambda: _midtrain_steps(MIDTRAIN_9B),
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

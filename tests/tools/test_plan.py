"""mimesis-plan on every shipped config: each fits its GPU at the layout of its stage's sbatch file with the kept
margin, and docs/layouts.md shows exactly the tables the plan prints today (no hand figures to drift)."""

import json
import re
from pathlib import Path

import pytest
import yaml
from megatron_mimesis.tools.plan import sbatch_layout

from megatron_mimesis.training.memory.gpus import MARGIN
from tests.training.memory import planning

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "launch" / "configs"
PAPER_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("demo_"))
DEMO_CONFIGS = sorted(p.name for p in CONFIGS.glob("demo_*.yaml"))
DOC_COMMAND = re.compile(r"^\$ mimesis-plan --config launch/configs/(\S+)$")


@pytest.fixture(scope="module")
def paper_plans(planner):
    """config file -> (exit status, the table, the plan as JSON), each planned once in the planning process."""
    plans = {}
    for name in PAPER_CONFIGS:
        config = str(CONFIGS / name)
        status, table, _ = planner.submit(planning.run_mimesis_plan, ["--config", config]).result()
        _, as_json, _ = planner.submit(planning.run_mimesis_plan, ["--config", config, "--json"]).result()
        plans[name] = (status, table, json.loads(as_json)["memory_plan"])
    return plans


def test_the_paper_configs_cover_every_stage_for_both_models_and_the_qwen3_agent():
    qwen35 = [f"{stage}_{size}.yaml" for stage in ("midtrain", "sft", "rl_simulator", "rl_agent") for size in ("4b", "9b")]
    qwen3 = ["rl_agent_qwen3_1.7b.yaml", "rl_agent_qwen3_4b.yaml", "rl_agent_qwen3_8b.yaml", "sft_qwen3_8b.yaml",
             "rl_agent_userrl_qwen3_8b.yaml"]
    assert PAPER_CONFIGS == sorted(qwen35 + qwen3)


def test_every_paper_config_fits_at_its_sbatch_layout_with_the_margin(paper_plans):
    for name, (status, table, plan) in paper_plans.items():
        stage = yaml.safe_load((CONFIGS / name).read_text())["stage"]
        nodes, gpus = sbatch_layout(str(CONFIGS / name), stage)
        assert f" on {nodes * gpus} GPUs;" in table.splitlines()[0], name
        assert status == 0 and plan["fits"], (name, table)
        for column in plan["columns"]:
            assert plan["total_gib"][column] <= (1 - MARGIN) * plan["capacity_gib"], (name, column)


def test_docs_layouts_show_the_tables_the_plan_prints(paper_plans):
    """Every ``$ mimesis-plan --config ...`` block in docs/layouts.md is followed by that command's output, verbatim."""
    lines = (REPO / "docs" / "layouts.md").read_text().splitlines()
    cited = {}
    for i, line in enumerate(lines):
        match = DOC_COMMAND.match(line)
        if match:
            end = lines.index("```", i)
            cited[match.group(1)] = "\n".join(lines[i + 1:end])
    assert sorted(cited) == PAPER_CONFIGS
    for name, shown in cited.items():
        assert shown == paper_plans[name][1].rstrip("\n"), f"docs/layouts.md: the table of {name} is stale"


def test_the_demo_configs_fit_on_their_two_processes(planner):
    for name in DEMO_CONFIGS:
        status, table, err = planner.submit(planning.run_mimesis_plan, ["--config", str(CONFIGS / name), "--nodes", "1",
                                                                        "--gpus-per-node", "2"]).result()
        assert status == 0 and " on 2 GPUs;" in table.splitlines()[0], (name, err)

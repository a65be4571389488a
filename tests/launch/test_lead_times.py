"""The SLURM lead times in ``launch/slurm/*.sbatch`` are the ones ``training/lead_times.py`` derives from each stage's
paper config (9B; the agent's Qwen3-8B): the share of a checkpoint that the busiest of the job's nodes writes (each
rank its optimizer shard and megatron's split of the weights, from the memory plan's states of the real model), at
the stated filesystem bandwidth."""

import re

import pytest

from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.training.config import TrainConfig
from megatron_mimesis.training.lead_times import lead_times
from megatron_mimesis.training.memory.checkpoint import GPUS_PER_NODE, write_seconds
from megatron_mimesis.training.memory.plan import planned_node_write_bytes
from tests.launch.slurm import REPO

CONFIGS = {"midtrain": TrainConfig, "sft": TrainConfig, "rl_simulator": SimulatorRLConfig, "rl_agent": AgentRLConfig}


@pytest.mark.parametrize("stage", list(CONFIGS))
def test_the_sbatch_lead_times_are_the_derived_ones(stage, planner):
    sbatch = (REPO / "launch" / "slurm" / f"{stage}.sbatch").read_text()
    launcher = (REPO / "launch" / re.search(r"exec bash launch/(\w+\.sh)", sbatch)[1]).read_text()
    config = CONFIGS[stage].from_yaml(REPO / re.search(r"^PAPER_CONFIG=(\S+)", launcher, re.M)[1])
    assert config.stage == stage
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)", sbatch, re.M)[1])
    written = planner.submit(planned_node_write_bytes, config, nodes * GPUS_PER_NODE).result()
    signal_lead, shutdown = lead_times(stage, write_seconds(max(written), config))
    assert re.findall(r"^#SBATCH --signal=B:USR1@(\d+)$", sbatch, re.M) == [str(signal_lead)]
    assert re.findall(r'^export SHUTDOWN_TIMEOUT="\$\{SHUTDOWN_TIMEOUT:-(\d+)\}"$', sbatch, re.M) == [str(shutdown)]
    # 9B (~9.4B parameters with the padded vocabulary), Qwen3-8B (8.2B) x 14 bytes (bf16 weights, fp32 main copy, Adam), spread evenly over the nodes: every rank
    # writes (data-parallel rank 0 alone used to write it all, from the first node)
    assert len(written) == nodes and 100 * 2**30 < sum(written) < 130 * 2**30
    assert max(written) < 1.01 * sum(written) / nodes


def test_a_phase_longer_than_the_lead_assumes_is_named_with_how_much_to_add():
    from megatron_mimesis.training.lead_times import LONGEST_WAIT_S, lead_warning

    assert lead_warning("rl_agent", LONGEST_WAIT_S["rl_agent"]) is None
    assert lead_warning("rl_agent", 701.2) == (
        "a phase took 701 s between two stop points, above the 600 s the SLURM lead times assume for rl_agent "
        "(training/lead_times.py): lengthen --signal=B:USR1@ and SHUTDOWN_TIMEOUT by 120 s, or a preemption may not "
        "save")

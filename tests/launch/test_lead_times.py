"""The SLURM lead times in ``launch/slurm/*.sbatch`` are the ones ``training/lead_times.py`` derives from each
stage's paper config (9B; the agent's Qwen3-8B): its checkpoint's size (the memory plan's states of the real model) written at the stated
filesystem bandwidth from the job's nodes."""

import re

import pytest

from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.training.config import TrainConfig
from megatron_mimesis.training.lead_times import lead_times
from megatron_mimesis.training.memory.checkpoint import GPUS_PER_NODE
from megatron_mimesis.training.memory.plan import planned_checkpoint_bytes
from tests.launch.slurm import REPO

CONFIGS = {"midtrain": TrainConfig, "sft": TrainConfig, "rl_simulator": SimulatorRLConfig, "rl_agent": AgentRLConfig}


@pytest.mark.parametrize("stage", list(CONFIGS))
def test_the_sbatch_lead_times_are_the_derived_ones(stage, planner):
    sbatch = (REPO / "launch" / "slurm" / f"{stage}.sbatch").read_text()
    launcher = (REPO / "launch" / re.search(r"exec bash launch/(\w+\.sh)", sbatch)[1]).read_text()
    config = CONFIGS[stage].from_yaml(REPO / re.search(r"^PAPER_CONFIG=(\S+)", launcher, re.M)[1])
    assert config.stage == stage
    world_size = int(re.search(r"^#SBATCH --nodes=(\d+)", sbatch, re.M)[1]) * GPUS_PER_NODE
    size = planner.submit(planned_checkpoint_bytes, config, world_size).result()
    signal_lead, shutdown = lead_times(stage, size, world_size)
    assert re.findall(r"^#SBATCH --signal=B:USR1@(\d+)$", sbatch, re.M) == [str(signal_lead)]
    assert re.findall(r'^export SHUTDOWN_TIMEOUT="\$\{SHUTDOWN_TIMEOUT:-(\d+)\}"$', sbatch, re.M) == [str(shutdown)]
    # 9B (~9.4B parameters with the padded vocabulary), Qwen3-8B (8.2B) x 14 bytes (bf16 weights, fp32 main copy, Adam)
    assert 100 * 2**30 < size < 130 * 2**30

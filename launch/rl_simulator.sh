#!/usr/bin/env bash
# Simulator RL with FoldGRPO (MIMESIS stage 1, last step). On SLURM: CONFIG (default
# launch/configs/rl_simulator_9b.yaml, vLLM rollouts) under one torchrun per node; elsewhere with CONFIG: one
# torchrun over the local GPUs (or CPU); with no CONFIG, GPUs or not: the embedded CPU demo, which starts from the
# mid-training demo's checkpoint and trains the tiny simulator on a toy domain (brief replies, a scripted
# counterpart), TP=2.
#   bash launch/rl_simulator.sh [--flag VALUE ...] [--dry-run]
# Environment: CONFIG, SAVE, NPROC, NNODES, GPUS_PER_NODE, PYTHON (launch/common.sh).
set -euo pipefail

STAGE=rl_simulator
TRAIN_MODULE=megatron_mimesis.rl.simulator_rl
PAPER_CONFIG=launch/configs/rl_simulator_9b.yaml  # the paper's 2x8 A100 run, vLLM colocated
DEMO_CONFIG=launch/configs/demo_rl_simulator.yaml

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rl_demo_defaults
launch "$@"

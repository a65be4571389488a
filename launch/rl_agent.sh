#!/usr/bin/env bash
# Agent RL with GRPO + CSD against the frozen user simulator (MIMESIS stage II). On SLURM: CONFIG
# (default launch/configs/rl_agent_userrl_qwen3_8b.yaml, what the paper ran: its Qwen3-8B agent on UserRL's gyms;
# rl_agent_qwen3_8b.yaml trains it on tau2, rl_agent_9b.yaml a Qwen3.5 agent; docs/stage2.md) under one torchrun per
# node; elsewhere with CONFIG: one torchrun over the local GPUs (or CPU); with no
# CONFIG, GPUs or not: the embedded CPU demo, which starts from the mid-training demo's checkpoint and trains the
# tiny model as the agent on the toy env (scripted user and coach), TP=2.
#   bash launch/rl_agent.sh [--flag VALUE ...] [--dry-run]
# Environment: CONFIG, SAVE, NPROC, NNODES, GPUS_PER_NODE, PYTHON (launch/common.sh).
set -euo pipefail

STAGE=rl_agent
TRAIN_MODULE=megatron_mimesis.rl.agent_rl
PAPER_CONFIG=launch/configs/rl_agent_userrl_qwen3_8b.yaml
DEMO_CONFIG=launch/configs/demo_rl_agent.yaml

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rl_demo_defaults
launch "$@"

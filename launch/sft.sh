#!/usr/bin/env bash
# Thought-supervised SFT (MIMESIS stage 2), from the mid-training checkpoint. On SLURM: the paper's 1x8 A100
# run (launch/slurm/sft.sbatch); elsewhere with CONFIG: one torchrun over the local GPUs (or CPU); with no CONFIG,
# GPUs or not: the embedded CPU demo, which builds the SFT sample and fine-tunes the demo mid-training checkpoint
# with TP=2.
#   bash launch/sft.sh [--trainer-flag VALUE ...] [--dry-run]
# Environment: CONFIG, DATA_PATH, PRETRAINED_HF, SAVE, NPROC, NNODES, GPUS_PER_NODE, PYTHON (launch/common.sh).
set -euo pipefail

STAGE=sft
PAPER_CONFIG=launch/configs/sft_9b.yaml
DEMO_CONFIG=launch/configs/demo_sft.yaml
# token ids must be those of the checkpoint being fine-tuned: reuse the mid-training demo's tokenizer
DEMO_PREP_ARGS=(--seq-length 256 --tokenizer .cache/data/chitchat-midtrain/tokenizer)
DEMO_NEEDS=(.cache/data/chitchat-midtrain/tokenizer runs/demo-midtrain/checkpoints/latest)
DEMO_NEEDS_HINT="run bash launch/midtrain.sh first (the SFT demo fine-tunes its checkpoint)"
DEMO_PLOT_ARGS=()

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch "$@"

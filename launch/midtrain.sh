#!/usr/bin/env bash
# User-side mid-training (MIMESIS stage 1). On SLURM: the paper's 4x8 A100 run (launch/slurm/midtrain.sbatch);
# elsewhere with CONFIG: one torchrun over the local GPUs (or CPU); with no CONFIG, GPUs or not: the embedded CPU
# demo, which builds the chit-chat dataset, trains the tiny model on 2 gloo processes and plots the loss.
#   bash launch/midtrain.sh [--trainer-flag VALUE ...] [--dry-run]
# Environment: CONFIG, DATA_PATH, PRETRAINED_HF, SAVE, NPROC, NNODES, GPUS_PER_NODE, PYTHON (launch/common.sh).
set -euo pipefail

STAGE=midtrain
PAPER_CONFIG=launch/configs/midtrain_9b.yaml
DEMO_CONFIG=launch/configs/demo_midtrain.yaml
# rows of the demo's seq_length and a BPE of the vocab the demo config declares (the trainer checks both)
DEMO_PREP_ARGS=(--seq-length 256 --vocab-size 8192)
DEMO_NEEDS=()
DEMO_NEEDS_HINT=""
DEMO_PLOT_ARGS=()

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch "$@"

#!/usr/bin/env bash
# The MIMESIS loop as one pipeline (megatron_mimesis/pipeline): with no arguments, the tiny presets end to end on
# CPU (launch/pipelines/demo.yaml; needs .venv and .venv-vllm: make pipeline builds both); on a cluster,
#   bash launch/pipeline.sh submit launch/pipelines/paper.yaml [--dry-run] [--given STAGE=PATH ...]
# submits the paper's chain as dependent SLURM jobs. Run again, it skips finished stages and resumes the
# interrupted one. Environment: PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if (($# == 0)) || [[ "$1" == -* ]]; then set -- run "$@"; fi
exec "$PYTHON" -m megatron_mimesis.pipeline "$@"

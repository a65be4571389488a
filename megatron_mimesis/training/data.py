"""Feeding packed rows to the schedule: the datasets, a resumable sampler, and the per-micro-batch inputs.

The sampler is Megatron-LM's pretraining sampler: step k of a run reads samples
``[k * global_batch, (k + 1) * global_batch)`` of the blended dataset, data-parallel rank r taking its
``micro_batch_size`` slice of each micro-batch. It needs nothing but ``consumed_samples`` to resume at
the exact next sample, which is what a checkpoint stores. Every pipeline stage reads the batch too: each
needs the document boundaries (attention and DeltaNet state restart there), the first stage the tokens
and the last the labels.

Loader workers are the rank's helpers, not targets of its signals: torchrun and srun deliver SIGTERM / SIGUSR1
to the rank's whole process group, and a worker that died of it would make the rank raise before it saves. The
workers ignore those signals (the rank acts on them and then closes its loader, which ends them) and die with
the rank however it ends (:mod:`megatron_mimesis.lifetime`).
"""

import json
import os
import signal
import tempfile
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state

from megatron_mimesis.data.blend import build_blended_datasets
from megatron_mimesis.data.collate import collate_packed, packed_seq_params
from megatron_mimesis.lifetime import die_with_parent
from megatron_mimesis.training.config import ConfigError
from megatron_mimesis.training.signals import ExitSignal

SHM_DIR = "/dev/shm"  # where torch's shared-memory tensors live on Linux (shm_open)


class MicroBatchSampler:
    """Index lists of one micro-batch for this data-parallel rank, from ``consumed_samples`` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self):
        stride = self.micro_batch_size * self.dp_size
        for start in range(self.consumed_samples, self.total_samples - stride + 1, stride):
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))


def dataset_manifest(data_path: str | Path) -> dict:
    path = Path(data_path) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no manifest; is {data_path} a data_prep output directory?")
    return json.loads(path.read_text())


def check_worker_shared_memory(num_workers: int) -> None:
    """Refuse, before any process starts, loader workers that could not hand a batch over: they pass tensors
    through POSIX shared memory (``SHM_DIR``), which containers often mount read-only or tiny."""
    if num_workers == 0:
        return
    try:
        with tempfile.NamedTemporaryFile(dir=SHM_DIR, prefix="mimesis-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{SHM_DIR}: not writable ({exc.strerror}); DataLoader workers pass batches through "
                          f"shared memory there: make it writable or set num_workers: 0") from None


def build_datasets(data_path: str | Path, seq_length: int, train_samples: int, valid_samples: int, seed: int):
    mixture = Path(data_path) / "mixture.json"
    if not mixture.exists():
        raise FileNotFoundError(f"{mixture}: no mixture file; is {data_path} a data_prep output directory?")
    return build_blended_datasets(mixture, seq_length, train_samples, valid_samples, seed=seed)


def make_loader(dataset, total_samples: int, consumed_samples: int, micro_batch_size: int, num_workers: int):
    sampler = MicroBatchSampler(
        total_samples, consumed_samples, micro_batch_size,
        parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
    )
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_packed, num_workers=num_workers,
        persistent_workers=num_workers > 0, worker_init_fn=partial(_init_worker, os.getpid()),
    )


def _init_worker(rank_pid: int, worker_id: int) -> None:
    die_with_parent(rank_pid)
    for sig in ExitSignal.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def model_inputs(batch: dict, device: torch.device) -> dict:
    """A collated micro-batch [B, L] -> one THD row [1, B*L] and its PackedSeqParams, on ``device``."""
    inputs = {name: batch[name].reshape(1, -1).to(device, non_blocking=True)
              for name in ("tokens", "labels", "loss_mask", "position_ids")}
    moved = {**batch, "cu_seqlens": batch["cu_seqlens"].to(device, non_blocking=True)}
    inputs["packed_seq_params"] = packed_seq_params(moved)
    return inputs

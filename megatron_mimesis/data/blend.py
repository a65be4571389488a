"""Train/valid datasets from a ``data_prep`` mixture file, through megatron-core's blended dataset builder.

``mixture.json`` is Megatron-LM's ``--per-split-data-args-path`` format, ``{"train": [weight, prefix, ...],
"valid": [...]}``. ``build_blended_datasets`` hands it to ``BlendedMegatronDatasetBuilder`` with
``PackedConversationMegatronDataset`` as the per-corpus class: each corpus is shuffled per epoch and repeated as
often as its weight requires, and corpora are interleaved by megatron-core's ``BlendedDataset`` (its index
helpers are the compiled ``megatron.core.datasets.helpers_cpp`` shipped in the megatron-core wheel, so no C++
build is needed here). Items are those of ``PackedConversationDataset`` plus ``dataset_id`` from the blend.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron_mimesis.data.packed import PackedConversationDataset


def _shuffle_seed(random_seed: int, dataset_path: str | None, index_split: Split, num_samples: int) -> int:
    """The corpus's shuffle seed, from what identifies it inside its mixture (corpus directory and file names,
    split, sample count) rather than megatron's description hash, which holds the absolute path: the same data
    prepared under another directory (another filesystem, a test's temporary directory) must train in the same
    order, or runs and their resumes would not reproduce."""
    corpus = "/".join(Path(dataset_path).parts[-2:]) if dataset_path else ""
    key = f"{corpus}|{index_split.name}|{num_samples}".encode()
    return (random_seed + int(hashlib.md5(key, usedforsecurity=False).hexdigest()[:8], 16)) % 2**32


class PackedConversationMegatronDataset(MegatronDataset):
    """One corpus's packed rows as a megatron-core mid-level dataset: ``num_samples`` rows, shuffled per epoch."""

    def __init__(
        self,
        dataset: PackedConversationDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        if len(dataset) and dataset.seq_length != config.sequence_length:
            raise ValueError(
                f"{dataset_path}: rows have {dataset.seq_length} tokens, config.sequence_length is "
                f"{config.sequence_length}"
            )
        wanted = len(indices) if num_samples is None else num_samples
        epochs = -(-wanted // len(indices)) if len(indices) else 0
        rng = np.random.RandomState(_shuffle_seed(config.random_seed, dataset_path, index_split, wanted))
        order = [rng.permutation(indices) for _ in range(epochs)]
        self.sample_index = np.concatenate(order)[:wanted] if order else np.zeros(0, dtype=np.int64)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: PackedConversationDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> PackedConversationDataset:
        return PackedConversationDataset(dataset_path)

    def __len__(self) -> int:
        return len(self.sample_index)

    def __getitem__(self, idx: int) -> dict:
        return self.dataset[int(self.sample_index[idx])]


def build_blended_datasets(
    mixture_path: str | Path, seq_length: int, train_samples: int, valid_samples: int, seed: int = 1234
) -> tuple:
    """(train, valid) datasets of ``train_samples`` / ``valid_samples`` rows (valid is None when the mixture has
    no valid split). A corpus alone in a split comes back as a ``PackedConversationMegatronDataset`` of exactly
    that many rows, several as a megatron-core ``BlendedDataset``, which may hold a few rows more (megatron-core
    rounds each corpus's share up)."""
    mixture = json.loads(Path(mixture_path).read_text())
    config = BlendedMegatronDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend_per_split=[get_blend_from_list(mixture.get("train")), get_blend_from_list(mixture.get("valid")), None],
    )
    builder = BlendedMegatronDatasetBuilder(
        PackedConversationMegatronDataset, [train_samples, valid_samples, None], lambda: True, config
    )
    train, valid, _ = builder.build()
    return train, valid

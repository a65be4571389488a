"""Datasets the trainers read.

* ``PackedConversationDataset(path_prefix)`` -- packed rows written by ``data_prep`` (item format in
  ``megatron_mimesis.data.packed``).
* ``collate_packed`` / ``packed_seq_params`` -- micro-batches and megatron ``PackedSeqParams(qkv_format="thd")``.
* ``build_blended_datasets(mixture_path, seq_length, train_samples, valid_samples)`` -- train/valid through
  megatron-core's ``BlendedMegatronDatasetBuilder``.
"""

from megatron_mimesis.data.blend import PackedConversationMegatronDataset, build_blended_datasets
from megatron_mimesis.data.collate import collate_packed, packed_seq_params
from megatron_mimesis.data.packed import PackedConversationDataset

__all__ = [
    "PackedConversationDataset",
    "PackedConversationMegatronDataset",
    "build_blended_datasets",
    "collate_packed",
    "packed_seq_params",
]

"""Packed conversation rows written by ``data_prep``, read as training items.

On-disk contract (one dataset = one path prefix, e.g. ``.cache/data/chitchat-midtrain/chitchat/train``):

* ``{prefix}.bin/.idx`` -- a megatron-core ``IndexedDataset`` of token ids. Each megatron *document* is one
  packed row of exactly ``seq_length`` tokens; its *sequences* are the conversation samples in that row,
  followed by one padding sequence (``<|endoftext|>``) when the samples do not fill the row.
* ``{prefix}_loss_mask.bin/.idx`` -- the same structure in uint8: 1 where the token itself is a target token
  (a user turn's content or its ``<|im_end|>``), aligned with the tokens, not shifted.

Item of ``PackedConversationDataset[i]`` (L = seq_length):

* ``tokens`` [L] int64 -- the row.
* ``labels`` [L] int64 -- next-token targets: ``labels[t] = tokens[t + 1]`` inside a segment; at the last
  position of each segment (where the next token belongs to another sample) the label is 0 and masked out.
* ``loss_mask`` [L] float32 -- 1.0 where ``labels[t]`` is a target token, else 0.0.
* ``position_ids`` [L] int64 -- restart at 0 at every segment (the padding is a segment too).
* ``cu_seqlens`` [segments + 1] int32 -- segment boundaries ``[0, ..., L]``; padding, when present, is the
  final segment (its loss mask is all zero). Use ``collate_packed`` / ``packed_seq_params`` to batch it.
"""

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

LOSS_MASK_SUFFIX = "_loss_mask"


class PackedConversationDataset(torch.utils.data.Dataset):
    """Rows of one packed dataset, in stored order (shuffle with the sampler or ``build_blended_datasets``)."""

    def __init__(self, path_prefix: str):
        self.path_prefix = str(path_prefix)
        self.tokens = IndexedDataset(self.path_prefix)
        self.loss_masks = IndexedDataset(self.path_prefix + LOSS_MASK_SUFFIX)
        self.row_starts = self.tokens.document_indices
        if not np.array_equal(self.row_starts, self.loss_masks.document_indices) or not np.array_equal(
            self.tokens.sequence_lengths, self.loss_masks.sequence_lengths
        ):
            raise ValueError(f"{self.path_prefix}: tokens and loss masks are not aligned")
        row_lengths = np.add.reduceat(self.tokens.sequence_lengths, self.row_starts[:-1]) if len(self) else []
        lengths = set(np.asarray(row_lengths).tolist())
        if len(lengths) > 1:
            raise ValueError(f"{self.path_prefix}: rows of different lengths {sorted(lengths)}")
        self.seq_length = lengths.pop() if lengths else 0

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        first, last = int(self.row_starts[index]), int(self.row_starts[index + 1])
        tokens = np.concatenate(self.tokens[first:last]).astype(np.int64)
        targets = np.concatenate(self.loss_masks[first:last]).astype(np.float32)
        segment_lengths = self.tokens.sequence_lengths[first:last].astype(np.int64)
        cu_seqlens = np.concatenate([[0], np.cumsum(segment_lengths)])
        segment_ends = cu_seqlens[1:] - 1

        labels = np.empty_like(tokens)
        labels[:-1] = tokens[1:]
        labels[segment_ends] = 0
        loss_mask = np.zeros_like(targets)
        loss_mask[:-1] = targets[1:]
        loss_mask[segment_ends] = 0.0
        position_ids = np.arange(len(tokens), dtype=np.int64) - np.repeat(cu_seqlens[:-1], segment_lengths)
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids),
            "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
        }

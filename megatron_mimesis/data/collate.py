"""Batch packed rows and describe their document boundaries for megatron's ``thd`` packed-sequence path.

``collate_packed`` stacks the per-token fields to [B, L] and flattens the per-row ``cu_seqlens`` across the
micro-batch (row b's boundaries shifted by b * L), which is the layout ``PackedSeqParams(qkv_format="thd")``
expects when the [B, L] batch is viewed as one sequence of B * L tokens. ``packed_seq_params`` builds that
object; the trainer moves ``cu_seqlens`` to the device with the batch.
"""

import torch
from megatron.core.packed_seq_params import PackedSeqParams

TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def collate_packed(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor | int]:
    """Rows of ``PackedConversationDataset`` (or the blended datasets) -> one micro-batch.

    Returns the stacked token fields plus ``cu_seqlens`` [segments + 1] int32 over the flattened batch and
    ``max_seqlen`` (int, the longest segment). Other keys of the rows (e.g. ``dataset_id``) are dropped.
    """
    batch: dict[str, torch.Tensor | int] = {name: torch.stack([row[name] for row in rows]) for name in TOKEN_FIELDS}
    row_length = rows[0]["tokens"].numel()
    boundaries = [torch.zeros(1, dtype=torch.int32)]
    for index, row in enumerate(rows):
        boundaries.append(row["cu_seqlens"][1:].to(torch.int32) + index * row_length)
    cu_seqlens = torch.cat(boundaries)
    batch["cu_seqlens"] = cu_seqlens
    batch["max_seqlen"] = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return batch


def packed_seq_params(batch: dict[str, torch.Tensor | int]) -> PackedSeqParams:
    """The ``PackedSeqParams`` for a batch from ``collate_packed`` (same boundaries for queries and keys)."""
    cu_seqlens = batch["cu_seqlens"]
    max_seqlen = batch["max_seqlen"]
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )

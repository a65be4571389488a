"""A step's training rows as a few flat tensors: what the data-parallel ranks exchange, what the rollout correction
and the advantages read, and what the update's micro-batches are cut from.

Each rank folds its own episodes into ``TrainingRow`` records (Python lists of its own tokens) and turns them into
one :class:`StepRows`: the rows' tokens end to end, each row's length and context length, its group, rollout and
reward, and one column per field of the response tokens (the old log-probs, the sampling engine's, the CSD teacher's,
the KL reference's; later the rollout-correction weights). :meth:`StepRows.gathered` gives every rank every rank's
rows through ``all_gather`` of their sizes and of four tensors; every rank needs them all, since the micro-batch plan balances the rows
across ranks by token count and FoldGRPO's group statistics read every rollout. Before, every rank built per-token
Python lists of all ranks' rows and received them pickled through ``all_gather_object``: tens of seconds and GBs of
host memory a step at ~20M tokens (``tools/bench/bench_rl_rows.py`` measures both ways at ~2M tokens).
"""

from dataclasses import dataclass, replace
from itertools import chain

import torch
import torch.distributed as dist

from megatron_mimesis.rl.types import TrainingRow

# fields of the response tokens, in the order they travel
RESPONSE_FIELDS = ("old_logprobs", "engine_logprobs", "teacher_logprobs", "ref_logprobs", "rollout_weights")
# the fields of a micro-batch, one value per position; the integer ones are int64, the others float32
TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "old_logprobs", "advantages", "teacher_logprobs", "ref_logprobs",
                "rollout_weights", "position_ids")
INTEGER_FIELDS = ("tokens", "labels", "position_ids")


@dataclass(frozen=True)
class StepRows:
    tokens: torch.Tensor  # int64 [T]: each row's context, then its response, row after row
    lengths: torch.Tensor  # int64 [R]
    context_lengths: torch.Tensor  # int64 [R]
    group_ids: torch.Tensor  # int64 [R]
    rollout_ids: torch.Tensor  # int64 [R]
    rewards: torch.Tensor  # float64 [R]
    response: dict  # field name -> float64 [S], one value per response token, rows in order (only fields present)

    @classmethod
    def of(cls, pairs: list[tuple[list[int], list[int]]], response: dict | None = None, group_ids=(),
           rollout_ids=(), rewards=()) -> "StepRows":
        """Rows of ``(context_ids, response_ids)``; ``response``: field -> one list per row, of its response tokens'
        values; the per-row lists may be empty (rows that only need scoring)."""
        return cls(
            tokens=torch.tensor(list(chain.from_iterable(c + r for c, r in pairs)), dtype=torch.long),
            lengths=torch.tensor([len(c) + len(r) for c, r in pairs], dtype=torch.long),
            context_lengths=torch.tensor([len(c) for c, _ in pairs], dtype=torch.long),
            group_ids=torch.tensor(list(group_ids), dtype=torch.long),
            rollout_ids=torch.tensor(list(rollout_ids), dtype=torch.long),
            rewards=torch.tensor(list(rewards), dtype=torch.float64),
            response={name: torch.tensor(list(chain.from_iterable(values)), dtype=torch.float64)
                      for name, values in (response or {}).items()})

    @classmethod
    def of_rows(cls, rows: list[TrainingRow], teacher: list[list[float]] | None = None,
                ref: list[list[float]] | None = None) -> "StepRows":
        """This rank's rows; rows sampled by the training model itself carry no engine log-probs, and theirs are
        then their old ones (nothing to correct)."""
        response = {"old_logprobs": [r.response_logprobs for r in rows]}
        if any(r.engine_logprobs is not None for r in rows):
            response["engine_logprobs"] = [r.response_logprobs if r.engine_logprobs is None else r.engine_logprobs
                                           for r in rows]
        if teacher is not None:
            response["teacher_logprobs"] = teacher
        if ref is not None:
            response["ref_logprobs"] = ref
        for r in rows:
            if len(r.response_logprobs) != len(r.response_ids) or not r.context_ids:
                raise ValueError("a row needs a non-empty context and one log-prob per response token")
        return cls.of([(r.context_ids, r.response_ids) for r in rows], response, [r.group_id for r in rows],
                      [r.rollout_id for r in rows], [r.reward for r in rows])

    def __len__(self) -> int:
        return self.lengths.numel()

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.lengths - self.context_lengths

    def response_row_index(self) -> torch.Tensor:
        """The row of each response token, [S]."""
        return torch.repeat_interleave(torch.arange(len(self), device=self.lengths.device), self.response_lengths)

    def with_response(self, name: str, values: torch.Tensor) -> "StepRows":
        return replace(self, response={**self.response, name: values})

    def select(self, keep: torch.Tensor) -> "StepRows":
        """The rows where ``keep`` ([R] bool) is true, in order."""
        rows = torch.arange(len(self), device=self.lengths.device)
        token_rows = torch.repeat_interleave(rows, self.lengths)
        return StepRows(tokens=self.tokens[keep[token_rows]], lengths=self.lengths[keep],
                        context_lengths=self.context_lengths[keep], group_ids=self.group_ids[keep],
                        rollout_ids=self.rollout_ids[keep], rewards=self.rewards[keep],
                        response={name: values[keep[self.response_row_index()]]
                                  for name, values in self.response.items()})

    def gathered(self, group, device) -> "StepRows":
        """Every rank's rows of ``group``, rank after rank, on every rank (collective), in host memory. A response
        field some rank lacks (a rank without rows sampled elsewhere) is filled there: engine log-probs by the old
        ones, others by zeros. The tensors travel on ``device``, the one the group's backend takes, and come back
        to the host: the update puts one micro-batch at a time on the device (``microbatch``), so a step's rows
        (0.5-1.5 GiB at tau2 volumes) never sit in GPU memory beside the activations."""
        if group is None or dist.get_world_size(group) == 1:
            return self
        world = dist.get_world_size(group)
        response_tokens = int(self.response_lengths.sum())
        shape = torch.tensor([self.tokens.numel(), len(self), response_tokens,
                              *(name in self.response for name in RESPONSE_FIELDS)], dtype=torch.long, device=device)
        shapes = [torch.empty_like(shape) for _ in range(world)]
        dist.all_gather(shapes, shape, group=group)
        shapes = torch.stack(shapes).cpu()
        names = [name for k, name in enumerate(RESPONSE_FIELDS) if shapes[:, 3 + k].any()]
        filled = {name: self.response.get(name, self.response["old_logprobs"] if name == "engine_logprobs" and
                                          "old_logprobs" in self.response else
                                          torch.zeros(response_tokens, dtype=torch.float64))
                  for name in names}
        per_row = torch.stack([self.lengths, self.context_lengths, self.group_ids, self.rollout_ids], dim=1)
        per_token = torch.stack([filled[name] for name in names], dim=1) if names else \
            torch.zeros(response_tokens, 0, dtype=torch.float64)
        tokens, per_row, rewards, per_token = (
            _all_gather_rows(tensor, shapes[:, column], group, device)
            for tensor, column in ((self.tokens, 0), (per_row, 1), (self.rewards, 1), (per_token, 2)))
        return StepRows(tokens=tokens, lengths=per_row[:, 0], context_lengths=per_row[:, 1], group_ids=per_row[:, 2],
                        rollout_ids=per_row[:, 3], rewards=rewards,
                        response={name: per_token[:, k] for k, name in enumerate(names)})

    def microbatches(self, plan: list[list[int]], advantages: torch.Tensor | None, pad_to_multiple: int, device):
        """The micro-batches of ``plan`` (row indices each), each put on ``device`` only when the schedule asks for
        it, and the longest one's length (what megatron's schedule sizes its pipeline buffers by)."""
        lengths = self.lengths.tolist()
        longest = max(_padded(sum(lengths[i] for i in mb) or 1, pad_to_multiple) for mb in plan)
        return (self.microbatch(mb, advantages, pad_to_multiple, device) for mb in plan), longest

    def microbatch(self, indices: list[int], advantages: torch.Tensor | None, pad_to_multiple: int, device) -> dict:
        """Rows ``indices`` as one THD micro-batch [1, T] with cu_seqlens; position t predicts token t + 1, so a
        response token's fields sit at the position before it. The loss mask covers the response tokens whose
        rollout-correction weight is not 0 (a 0 is a rejected token: it weighs nothing and counts in no mean).
        No rows give a 1-token pad row, which carries no loss."""
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        response_starts = torch.cumsum(self.response_lengths, 0) - self.response_lengths
        parts = {name: [] for name in TOKEN_FIELDS}
        for i in indices:
            n, context = int(self.lengths[i]), int(self.context_lengths[i])
            start, span = int(starts[i]), slice(int(response_starts[i]), int(response_starts[i]) + n - context)
            tokens = self.tokens[start:start + n]
            parts["tokens"].append(tokens)
            parts["labels"].append(torch.cat([tokens[1:], tokens.new_zeros(1)]))
            parts["position_ids"].append(torch.arange(n, device=tokens.device))
            weights = self.response["rollout_weights"][span] if "rollout_weights" in self.response else None
            on = torch.zeros(n, dtype=torch.float64, device=tokens.device)
            on[context - 1:n - 1] = 1.0 if weights is None else (weights != 0).double()
            parts["loss_mask"].append(on)
            advantage = torch.zeros(n, dtype=torch.float64, device=tokens.device)
            advantage[context - 1:n - 1] = 0.0 if advantages is None else float(advantages[i])
            parts["advantages"].append(advantage)
            for name in ("old_logprobs", "teacher_logprobs", "ref_logprobs", "rollout_weights"):
                values = torch.zeros(n, dtype=torch.float64, device=tokens.device)
                if name in self.response:
                    values[context - 1:n - 1] = self.response[name][span]
                elif name == "rollout_weights":
                    values[context - 1:n - 1] = 1.0
                parts[name].append(values)
        lengths = [int(self.lengths[i]) for i in indices] or [1]
        pad = (-sum(lengths)) % pad_to_multiple
        batch = {}
        for name, values in parts.items():  # the engine's log-probs are the rollout correction's, not the loss's
            flat = torch.cat(values) if values else torch.zeros(1, dtype=torch.float64)
            flat = torch.cat([flat, flat.new_zeros(pad)])
            dtype = torch.long if name in INTEGER_FIELDS else torch.float32
            batch[name] = flat.to(device=device, dtype=dtype).unsqueeze(0)
        batch["cu_seqlens"] = torch.tensor([0, *lengths, *([pad] if pad else [])]).cumsum(0).to(torch.int32).to(device)
        batch["max_seqlen"] = max(lengths + [pad])
        return batch


def _padded(tokens: int, multiple: int) -> int:
    return tokens + (-tokens) % multiple


def _all_gather_rows(tensor: torch.Tensor, counts: torch.Tensor, group, device) -> torch.Tensor:
    """``tensor``'s rows from every rank of ``group`` (``counts``: how many each has), concatenated in rank order:
    one all-gather of the tensor padded to the largest count."""
    padded = tensor.new_zeros((int(counts.max()), *tensor.shape[1:])).to(device)
    padded[:tensor.shape[0]] = tensor.to(device)
    parts = [torch.empty_like(padded) for _ in range(len(counts))]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:int(n)] for part, n in zip(parts, counts, strict=True)]).cpu()

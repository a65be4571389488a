"""A rollout engine that samples with the project's own megatron model, at any TP/PP layout.

For CPU runs and tests (and a reference for the vLLM engine): no KV cache, because megatron-core's Gated
DeltaNet has no inference path yet, so every decoding step re-runs the forward over the active sequences,
packed into one THD row so that each sequence attends (and carries DeltaNet state) only within itself. Every
rank of a model-parallel group calls ``generate`` with the same prompts; the last pipeline stage samples
from the full-vocabulary logits and broadcasts the tokens along the pipeline, so all ranks agree. Log-probs are
those of the untempered distribution (temperature and top-p only shape the sampling), as the policy loss
recomputes them from the same model. The logits are cut to the model's real vocabulary (the rows megatron pads the
output layer with are no tokens), the same one the trainer's softmax and vLLM's sampler cover.
"""

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model

from megatron_mimesis.models.config import real_vocab
from megatron_mimesis.rl.engines.protocol import sample_tokens
from megatron_mimesis.rl.types import Generation, SamplingParams


class LocalEngine:
    def __init__(self, model_chunks, tokenizer, device: torch.device):
        self.model = model_chunks if isinstance(model_chunks, list) else [model_chunks]
        self.tokenizer = tokenizer
        self.device = device

    def sleep(self) -> None:
        """Nothing to release: the engine's model lives in the training process."""

    def wake(self) -> None:
        """Nothing to restore."""

    def load_weights(self, named_tensors, preset, padded_vocab: int) -> None:
        """Take HF-named weights (what :func:`megatron_mimesis.rl.engines.weight_sync.sync_weights` streams, the same
        names vLLM loads) into this engine's model, when it is a copy rather than the training model itself."""
        from megatron_mimesis.models.hf_weights import load_hf_weights

        state = dict(named_tensors)
        for chunk in self.model:
            load_hf_weights(getattr(chunk, "module", chunk), state, preset, padded_vocab)

    # ------------------------------------------------------------------
    def _packed_row(self, seqs: list[list[int]]):
        tp = parallel_state.get_tensor_model_parallel_world_size()
        lengths = [len(s) for s in seqs]
        total = sum(lengths)
        pad = (-total) % tp if self.model[0].config.sequence_parallel else 0
        tokens = torch.tensor([t for s in seqs for t in s] + [0] * pad, device=self.device).unsqueeze(0)
        positions = torch.cat([torch.arange(n) for n in lengths + ([pad] if pad else [])]).to(self.device)
        cu = torch.tensor([0, *torch.tensor(lengths + ([pad] if pad else [])).cumsum(0).tolist()],
                          dtype=torch.int32, device=self.device)
        longest = max(lengths + [pad])
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        return tokens, positions.unsqueeze(0), params, last

    def _forward_step(self, row, data_iterator, model):
        tokens, positions, params, last = row
        next(data_iterator)
        logits = model(tokens, positions, None, packed_seq_params=params, runtime_gather_output=True)

        def keep_last_logits(output, non_loss_data=False):  # called on the last pipeline stage only
            return output[0, last, :real_vocab(get_attr_wrapped_model(model, "output_layer"))].float()

        return logits, keep_last_logits

    @torch.no_grad()
    def last_logits(self, seqs: list[list[int]]) -> torch.Tensor | None:
        """Full-vocabulary logits at the last position of each sequence, on the last pipeline stage (else None)."""
        row = self._packed_row(seqs)
        chunks = len(self.model)
        iterators = [iter([None]) for _ in range(chunks)] if chunks > 1 else iter([None])
        out = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, row), data_iterator=iterators, model=self.model,
            num_microbatches=1, seq_length=row[0].shape[1], micro_batch_size=1, forward_only=True,
            collect_non_loss_data=True,
        )
        return out[0] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None

    def _share_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return tensor

    # ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        for m in self.model:
            m.eval()
        generator = torch.Generator(device=self.device).manual_seed(sampling.seed or 0)
        responses: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        active = list(range(len(prompts)))
        for _ in range(sampling.max_new_tokens):
            if not active:
                break
            logits = self.last_logits([prompts[i] + responses[i] for i in active])
            picked = torch.zeros(2, len(active), device=self.device)
            if logits is not None:
                tokens = sample_tokens(logits, sampling, generator)
                picked[0] = tokens.float()
                picked[1] = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
            picked = self._share_from_last_stage(picked)
            still = []
            for j, i in enumerate(active):
                token = int(picked[0, j].item())
                responses[i].append(token)
                logprobs[i].append(float(picked[1, j].item()))
                if token in sampling.stop_token_ids:
                    finish[i] = "stop"
                else:
                    still.append(i)
            active = still
        for m in self.model:
            m.train()
        return [Generation(token_ids=r, text=self.tokenizer.decode(r, skip_special_tokens=False), logprobs=lp,
                           finish_reason=f) for r, lp, f in zip(responses, logprobs, finish, strict=True)]

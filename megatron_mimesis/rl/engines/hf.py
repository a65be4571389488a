"""A rollout engine on a transformers causal LM: an exported HF checkpoint sampled in this process.

For evaluating a model without a megatron process group or a vLLM server (CPU, a laptop GPU, tests). It decodes
one prompt at a time with the model's own KV / recurrent-state cache: slow next to vLLM, but exact, so what it
samples is what the checkpoint says. Serve the checkpoint with ``vllm serve`` and use
:class:`~megatron_mimesis.rl.engines.openai.OpenAICompletionsEngine` for evaluations at scale.

Sampling follows the other engines: temperature 0 is greedy, top-p keeps the smallest head of the tempered
distribution whose mass reaches ``top_p``, and the reported log-probs are those of the untempered distribution.
Each request of a call draws from its own generator seeded by :class:`~megatron_mimesis.rl.engines.protocol.SeedStream`, so a call with the same seed
reproduces and identical prompts within one call still draw independent samples.
"""

import inspect

import torch

from megatron_mimesis.rl.engines.protocol import SeedStream, sample_tokens
from megatron_mimesis.rl.types import Generation, SamplingParams


class HFEngine:
    def __init__(self, model, tokenizer, seed: int = 0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.seeds = SeedStream(seed)
        # transformers renamed the decoding cache (argument and output field) from past_key_values to cache after
        # 5.19, which vLLM 0.32 still needs; setup.py admits both
        forward = inspect.signature(self.model.forward).parameters
        self._cache_field = "cache" if "cache" in forward else "past_key_values"

    @classmethod
    def from_pretrained(cls, path, tokenizer=None, device: str | None = None, dtype: str = "auto",
                        seed: int = 0) -> "HFEngine":
        """Load the checkpoint at ``path`` (its own tokenizer unless one is given) onto ``device`` (default: the
        first GPU when there is one)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path), seed=seed)

    def sleep(self) -> None:
        """Nothing to release: the model stays where it was loaded."""

    def wake(self) -> None:
        """Nothing to restore."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        seeds = self.seeds.for_call(sampling, len(prompts))
        return [self._generate_one(prompt, sampling, seed) for prompt, seed in zip(prompts, seeds, strict=True)]

    @torch.no_grad()
    def _generate_one(self, prompt: list[int], sampling: SamplingParams, seed: int) -> Generation:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        token_ids: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        inputs = torch.tensor([prompt], device=self.device)
        cache = None
        for _ in range(sampling.max_new_tokens):
            out = self.model(input_ids=inputs, use_cache=True, logits_to_keep=1, **{self._cache_field: cache})
            cache = getattr(out, self._cache_field)
            logits = out.logits[0, -1].float()
            token = int(sample_tokens(logits[None], sampling, generator)[0])
            token_ids.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            if token in sampling.stop_token_ids:
                finish = "stop"
                break
            inputs = torch.tensor([[token]], device=self.device)
        return Generation(token_ids=token_ids, text=self.tokenizer.decode(token_ids, skip_special_tokens=False),
                          logprobs=logprobs, finish_reason=finish)

"""The interface every rollout engine (the local megatron engine on CPU, vLLM on GPU, transformers, an endpoint,
test doubles) provides, and the sampling rules they share.

Episodes and counterparts depend only on this protocol, so the orchestration runs unchanged whichever engine
samples the tokens. Engines that seed each request themselves take the seeds from :class:`SeedStream`, and the
in-process ones sample with :func:`sample_tokens`, so "the same seed reproduces the call; identical prompts in
one call draw independent samples" and temperature / top-p mean one thing everywhere.
"""

import hashlib
import itertools
from typing import Protocol

import torch

from megatron_mimesis.rl.types import Generation, SamplingParams


def request_seeds(key: str, count: int) -> list[int]:
    """One seed per request of a call: distinct within the call, a function of the call's key alone, unrelated
    across keys; 63 bits, so a server that takes a signed int64 accepts them."""
    return [int.from_bytes(hashlib.blake2b(f"{key}/{i}".encode(), digest_size=8).digest(), "little") >> 1
            for i in range(count)]


class SeedStream:
    """The per-request seeds of an engine's calls: from the call's seed when it sets one, else from the engine's
    seed and a count of unseeded calls (a run still reproduces as a whole)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._unseeded_calls = itertools.count()

    def for_call(self, sampling: SamplingParams, count: int) -> list[int]:
        key = (f"seed {sampling.seed}" if sampling.seed is not None
               else f"engine seed {self.seed}, unseeded call {next(self._unseeded_calls)}")
        return request_seeds(key, count)


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token per row of [B, V] logits: greedy at temperature 0, else from the tempered distribution cut to
    the smallest head whose mass reaches ``top_p``."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > sampling.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt, in prompt order.

        A set ``sampling.seed`` seeds the whole call: the same call with the same seed reproduces its samples, and
        requests within one call still draw independent samples (identical prompts included, since the rollouts
        of one prompt are sent together). Generation stops at any of ``sampling.stop_token_ids``."""
        ...

    def sleep(self) -> None:
        """Release the accelerator memory held for generation (weights, KV cache) so training can use it."""
        ...

    def wake(self) -> None:
        """Take back what ``sleep`` released, before the next ``generate``."""
        ...

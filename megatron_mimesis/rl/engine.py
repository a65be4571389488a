"""The interface every rollout engine (the local megatron engine on CPU, vLLM on GPU, test doubles) provides.

Episodes and counterparts depend only on this protocol, so the orchestration runs unchanged whichever engine
samples the tokens."""

from typing import Protocol

from megatron_mimesis.rl.types import Generation, SamplingParams


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

"""A rollout engine over an OpenAI-compatible ``/v1/completions`` endpoint that takes token-id prompts.

``vllm serve`` of an exported checkpoint is the intended server: evaluating an agent then runs at vLLM's speed
without a training job. Prompts go out as token ids, so the server sees exactly the context the chat renderer
built (no second chat template on the server). One request per prompt, each with its own seed from
:class:`~megatron_mimesis.rl.engines.protocol.SeedStream` (a call with the same seed reproduces; identical prompts
draw independent samples), at most ``concurrency`` in flight; the openai client handles timeouts and retries.

vLLM request fields relied on (``vllm/entrypoints/openai/completion/protocol.py``, ``CompletionRequest``):
``prompt`` may be a list of token ids; ``stop_token_ids``, ``ignore_eos`` (stop on our stop ids alone),
``skip_special_tokens``, ``return_token_ids`` (the sampled ids come back as ``choices[i].token_ids``) and
``return_tokens_as_token_ids`` (logprob tokens read ``"token_id:{id}"``, for servers older than
``return_token_ids``) are vLLM extensions sent in ``extra_body``; ``logprobs=0`` returns the sampled tokens'
log-probs, which vLLM takes from the untempered distribution under its default ``--logprobs-mode raw_logprobs``.
A stop token id stays the last sampled id (its text is left out of ``text``; ``stop_reason`` names it). A
server that returns no ids at all gets its text re-encoded with the tokenizer, plus the ``stop_reason`` id (the
log-probs are then kept only when their count matches, else NaN: fine for evaluation, not for training).

A failed request (after the retries) raises :class:`EndpointError` naming the endpoint. With
``errors="return"`` it comes back instead as an empty generation whose ``finish_reason`` is ``"error: ..."``,
so an evaluation can finish the other episodes and exclude (and count) the failed ones rather than score them.
"""

import math
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import openai

from megatron_mimesis.rl.engines.protocol import SeedStream
from megatron_mimesis.rl.types import Generation, SamplingParams

_TOKEN_ID = re.compile(r"token_id:(\d+)")


class EndpointError(RuntimeError):
    """A completion request that failed after the client's retries; the message names the endpoint."""


class OpenAICompletionsEngine:
    def __init__(self, base_url: str, model: str, tokenizer, api_key: str | None = None, timeout_s: float = 600,
                 max_retries: int = 3, concurrency: int = 32, seed: int = 0, errors: str = "raise"):
        if errors not in ("raise", "return"):
            raise ValueError(f"errors must be 'raise' or 'return', not {errors!r}")
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                                    max_retries=max_retries)
        self.base_url, self.model, self.tokenizer = base_url, model, tokenizer
        self.concurrency = concurrency
        self.seeds = SeedStream(seed)
        self.errors = errors

    def sleep(self) -> None:
        """Nothing to release: the server owns the accelerator."""

    def wake(self) -> None:
        """Nothing to restore."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        seeds = self.seeds.for_call(sampling, len(prompts))
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(partial(self._complete, sampling=sampling), prompts, seeds))

    def _complete(self, prompt: list[int], seed: int, sampling: SamplingParams) -> Generation:
        try:
            response = self.client.completions.create(
                model=self.model, prompt=list(prompt), max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature, top_p=sampling.top_p, seed=seed, logprobs=0,
                extra_body={"stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": True,
                            "skip_special_tokens": False, "return_token_ids": True,
                            "return_tokens_as_token_ids": True})
        except openai.OpenAIError as error:
            return self._failed(f"{type(error).__name__}: {error}")
        if not response.choices:
            return self._failed("a response without choices")
        choice = response.choices[0]
        if choice.finish_reason not in ("stop", "length"):
            return self._failed(f"finish_reason {choice.finish_reason!r}")
        token_ids, logprobs = self._sampled(choice)
        return Generation(token_ids=token_ids, text=self.tokenizer.decode(token_ids, skip_special_tokens=False),
                          logprobs=logprobs, finish_reason=choice.finish_reason)

    def _sampled(self, choice) -> tuple[list[int], list[float]]:
        """The sampled ids, from the best source the server offers, and their log-probs."""
        logprobs = choice.logprobs
        token_ids = getattr(choice, "token_ids", None)
        if token_ids is None and logprobs is not None and logprobs.tokens:
            matches = [_TOKEN_ID.fullmatch(token) for token in logprobs.tokens]
            if all(matches):
                token_ids = [int(m.group(1)) for m in matches]
        if token_ids is None:
            # vLLM leaves a stop token's text out of the text; stop_reason names it
            token_ids = self.tokenizer.encode(choice.text, add_special_tokens=False)
            stop = getattr(choice, "stop_reason", None)
            if choice.finish_reason == "stop" and isinstance(stop, int) and token_ids[-1:] != [stop]:
                token_ids.append(stop)
        values = logprobs.token_logprobs if logprobs is not None else None
        if values is None or len(values) != len(token_ids):
            return list(token_ids), [math.nan] * len(token_ids)
        return list(token_ids), [math.nan if v is None else float(v) for v in values]

    def _failed(self, reason: str) -> Generation:
        message = f"completion request to {self.base_url} (model {self.model!r}) failed: {reason}"
        if self.errors == "raise":
            raise EndpointError(message)
        return Generation(token_ids=[], text="", logprobs=[], finish_reason=f"error: {message}")

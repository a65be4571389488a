"""The other side of a simulator rollout: the assistant that answers the simulated user.

A counterpart sees a public transcript from the assistant's point of view (``user`` messages are the simulator's
utterances, ``assistant`` messages its own replies) and answers all active episodes of a turn in one batched
call. A failure of one episode's reply comes back as that reply's ``error`` instead of raising, so one bad request
cannot sink a whole RL step. A counterpart may end the conversation (``done``); model-backed ones do so when their
reply contains ``end_marker``. Any thinking a model writes into its reply is dropped: the transcript stays public
for both sides.
"""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

import openai

from megatron_mimesis.rl.chat import ChatRenderer, strip_thinking
from megatron_mimesis.rl.engines.protocol import RolloutEngine
from megatron_mimesis.rl.types import SamplingParams


@dataclass(frozen=True)
class CounterpartReply:
    text: str | None  # None when there is nothing to add to the transcript
    done: bool  # the counterpart ends the conversation
    error: str | None = None


class Counterpart(Protocol):
    def reply_many(self, transcripts: list[list[dict]]) -> list[CounterpartReply]:
        """One reply per transcript, in order."""
        ...


def _model_reply(text: str, end_marker: str | None) -> CounterpartReply:
    """A model's raw reply as a public message, ending the conversation when it carries ``end_marker``."""
    _, text = strip_thinking(text)
    done = end_marker is not None and end_marker in text
    if done:
        text = text.replace(end_marker, "").strip()
    if not text and not done:
        return CounterpartReply(None, False, "empty reply")
    return CounterpartReply(text or None, done)


class ScriptedCounterpart:
    """Replies computed by ``fn(transcript) -> str`` (or None to end the conversation): tests and toy domains."""

    def __init__(self, fn: Callable[[list[dict]], str | None]):
        self.fn = fn

    def reply_many(self, transcripts: list[list[dict]]) -> list[CounterpartReply]:
        replies = []
        for transcript in transcripts:
            text = self.fn(transcript)
            replies.append(CounterpartReply(None, True) if text is None else CounterpartReply(text, False))
        return replies


class OpenAICounterpart:
    """A fixed assistant model behind an OpenAI-compatible chat completions endpoint.

    Requests run ``concurrency`` at a time; the client retries connection errors, timeouts, 429 and 5xx answers
    ``max_retries`` times with exponential backoff."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        system_prompt: str | None = None,
        end_marker: str | None = None,
        max_tokens: int = 512,
        temperature: float = 0.7,
        timeout_s: float = 60,
        max_retries: int = 3,
        concurrency: int = 8,
    ):
        # Local servers accept any key, but the client refuses to start without one.
        self.client = openai.OpenAI(
            base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=max_retries
        )
        self.model = model
        self.system_prompt = system_prompt
        self.end_marker = end_marker
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.concurrency = concurrency

    def reply_many(self, transcripts: list[list[dict]]) -> list[CounterpartReply]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._reply, transcripts))

    def _reply(self, transcript: list[dict]) -> CounterpartReply:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages = system + [{"role": m["role"], "content": m["content"]} for m in transcript]
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature
            )
        except openai.OpenAIError as error:
            return CounterpartReply(None, False, f"{type(error).__name__}: {error}")
        if not response.choices or response.choices[0].message.content is None:
            return CounterpartReply(None, False, "reply without content")
        return _model_reply(response.choices[0].message.content, self.end_marker)


class EngineCounterpart:
    """An assistant model sampled by a local rollout engine from the rendered transcript."""

    def __init__(
        self,
        engine: RolloutEngine,
        renderer: ChatRenderer,
        sampling: SamplingParams,
        system_prompt: str | None = None,
        end_marker: str | None = None,
    ):
        self.engine = engine
        self.renderer = renderer
        self.sampling = replace(sampling, stop_token_ids=renderer.stop_token_ids)
        self.system_prompt = system_prompt
        self.end_marker = end_marker

    def reply_many(self, transcripts: list[list[dict]]) -> list[CounterpartReply]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        prompts = [self.renderer.assistant_prompt(system + transcript) for transcript in transcripts]
        generations = self.engine.generate(prompts, self.sampling)
        return [_model_reply(self.renderer.split_thinking(g.text)[1], self.end_marker) for g in generations]

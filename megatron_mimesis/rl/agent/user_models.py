"""The frozen user simulator as the agent's environment: it plays the user from a private scenario.

A user model gets, per episode, its private instructions (the task's user scenario) and the public transcript
from the user's side (``user`` messages are its own earlier utterances, ``assistant`` messages the agent's public
text; tool calls and tool results are the agent's business and never shown). It answers with its private
thinking z (kept for the coach, never shown to the agent) and its public utterance x. Writing the stop marker
ends the conversation: the simulator's trained ``END_MARKER``, or what a model behind an endpoint is told to write
(``stop_marker``; a served export writes a client's own through ``megatron_mimesis.serving.marker_relay``). A
failed request comes back as that reply's ``error`` rather than raising.
"""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

import openai

from data_prep.render import END_MARKER
from megatron_mimesis.rl.chat import ChatRenderer, check_public, flip_roles, strip_thinking
from megatron_mimesis.rl.engines.protocol import RolloutEngine
from megatron_mimesis.rl.types import SamplingParams


@dataclass(frozen=True)
class UserReply:
    thinking: str | None  # private: for the coach only
    utterance: str  # public: the agent sees this
    done: bool  # the user ended the conversation (the stop marker is removed from the utterance)
    error: str | None = None


class UserModel(Protocol):
    def reply_many(self, instructions: list[str], transcripts: list[list[dict]],
                   seed: int | None = None) -> list[UserReply]:
        """One reply per (instructions, transcript) pair, in order; ``seed`` makes a sampling model reproducible."""
        ...


def _reply(thinking: str | None, utterance: str, stop_marker: str) -> UserReply:
    done = stop_marker in utterance
    utterance = utterance.replace(stop_marker, "").strip()
    if not utterance and not done:
        return UserReply(thinking, "", False, "empty utterance")
    return UserReply(thinking, utterance, done)


def _messages(instructions: str, transcript: list[dict]) -> list[dict]:
    check_public(transcript)
    return [{"role": "system", "content": instructions}, *transcript]


class EngineUserModel:
    """The simulator sampled by a rollout engine (vLLM or the local megatron engine) with its chat template."""

    def __init__(self, engine: RolloutEngine, renderer: ChatRenderer, sampling: SamplingParams):
        self.engine = engine
        self.renderer = renderer
        self.sampling = replace(sampling, stop_token_ids=renderer.stop_token_ids)

    def reply_many(self, instructions: list[str], transcripts: list[list[dict]],
                   seed: int | None = None) -> list[UserReply]:
        prompts = [self.renderer.user_prompt(_messages(i, t)) for i, t in zip(instructions, transcripts, strict=True)]
        generations = self.engine.generate(prompts, replace(self.sampling, seed=seed))
        return [_reply(*self.renderer.split_thinking(g.text), END_MARKER) for g in generations]


class OpenAIUserModel:
    """The simulator behind an OpenAI-compatible chat endpoint (e.g. ``vllm serve`` of the exported checkpoint).

    The request is in the convention of user-simulator frameworks (tau2-bench's ``UserSimulator``): the
    instructions as ``system``, the agent's turns as ``user``, the simulator's own as ``assistant``, the reply
    being the user's next turn. The export's chat template renders that into the simulator's training
    rendering, and a general chat model told to play the user reads it the same way.

    Thinking comes back either in the content (``<think>...</think>``) or, with a reasoning parser on the
    server, as ``reasoning_content``; both are treated as private."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, stop_marker: str = END_MARKER,
                 max_tokens: int = 1024, temperature: float = 1.0, timeout_s: float = 120, max_retries: int = 3,
                 concurrency: int = 16):
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                                    max_retries=max_retries)
        self.model = model
        self.stop_marker = stop_marker
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.concurrency = concurrency

    def reply_many(self, instructions: list[str], transcripts: list[list[dict]],
                   seed: int | None = None) -> list[UserReply]:
        seeds = [None if seed is None else seed * 100003 + k for k in range(len(transcripts))]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._reply, instructions, transcripts, seeds))

    def _reply(self, instructions: str, transcript: list[dict], seed: int | None) -> UserReply:
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=flip_roles(_messages(instructions, transcript)), max_tokens=self.max_tokens,
                temperature=self.temperature, **({"seed": seed} if seed is not None else {}))
        except openai.OpenAIError as error:
            return UserReply(None, "", False, f"{type(error).__name__}: {error}")
        if not response.choices or response.choices[0].message.content is None:
            return UserReply(None, "", False, "reply without content")
        message = response.choices[0].message
        thinking, utterance = strip_thinking(message.content)
        reasoning = getattr(message, "reasoning_content", None)
        thinking = "\n\n".join(t for t in (reasoning, thinking) if t) or None
        return _reply(thinking, utterance, self.stop_marker)


class ScriptedUserModel:
    """Replies computed by ``fn(instructions, transcript) -> (thinking, utterance)``: toy envs and tests."""

    def __init__(self, fn: Callable[[str, list[dict]], tuple[str | None, str]], stop_marker: str = END_MARKER):
        self.fn = fn
        self.stop_marker = stop_marker

    def reply_many(self, instructions: list[str], transcripts: list[list[dict]],
                   seed: int | None = None) -> list[UserReply]:
        return [_reply(*self.fn(i, _messages(i, t)[1:]), self.stop_marker)
                for i, t in zip(instructions, transcripts, strict=True)]

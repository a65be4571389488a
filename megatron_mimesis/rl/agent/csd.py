"""Coached on-policy self-distillation (CSD): a coach writes a note per agent turn from what only hindsight and
the user's private thoughts reveal; the teacher (the current weights, no grad) re-scores the student's own
sampled tokens with that note in its context; the gated log-likelihood term pulls the student towards tokens
the teacher likes.

For turn t the coach sees G(H_t, y_t, z_t, x_{t+1}): the public history the agent saw, the agent's message,
the user's next private thinking and next utterance (``templates/coach_note.txt``, filled with
``string.Template``). The note is appended to the teacher's system message under ``NOTE_HEADER``; the rest of
the teacher's context is the student's, rendered the same way by the agent's chat format (``agent_chat.py``), so the
teacher scores identical token ids after a context that differs only by the note. Notes exist only after the
rollouts of a step and only in teacher contexts; ``agent_chat.check_agent_context`` refuses any agent context
carrying the header.

A coach failure (an error, an empty note) drops that turn's CSD term and is counted; it never becomes a made-up
note. In the loss a dropped turn's teacher log-probs are -inf, which closes its gate exactly (g = 0). A step whose
coach failed more than ``max_coach_failure_fraction`` of its notes stops the run (:func:`check_coach_failures`): past
that, the run would be training plain GRPO under a CSD config.
"""

import math
import string
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import openai

from megatron_mimesis.rl.agent.agent_chat import shown
from megatron_mimesis.rl.agent.episodes import AgentEpisode
from megatron_mimesis.rl.chat import strip_thinking
from megatron_mimesis.rl.engines.protocol import RolloutEngine
from megatron_mimesis.rl.types import SamplingParams

COACH_TEMPLATE = Path(__file__).with_name("templates") / "coach_note.txt"
NO_GATE = float("-inf")  # teacher log-prob of a turn without a note: sigmoid(beta * (-inf - l)) = 0


@dataclass(frozen=True)
class NoteResult:
    note: str | None
    error: str | None = None


class Coach(Protocol):
    def notes_many(self, prompts: list[str]) -> list[NoteResult]:
        """One note per filled coach prompt, in order."""
        ...


class CoachFailed(RuntimeError):
    pass


def check_coach_failures(notes: list[NoteResult], bound: float, iteration: int) -> None:
    """Raise CoachFailed, naming the first error, when more than ``bound`` of ``notes`` failed."""
    failed = [n for n in notes if n.note is None]
    if notes and len(failed) > bound * len(notes):
        first = next((n.error for n in failed if n.error), "empty notes")
        raise CoachFailed(f"the coach failed {len(failed)} of {len(notes)} notes at iteration {iteration}, more than "
                          f"max_coach_failure_fraction {bound:g}: CSD would be off; first error: {first}")


def coach_prompt(chat, episode: AgentEpisode, turn_index: int, template: str) -> str:
    """The coach's prompt for one agent turn; ``chat`` (the agent's chat format) writes the tool calls as the agent
    wrote them. The history is the public transcript the agent saw (its system prompt is the coach's to know)."""
    turn = episode.turns[turn_index]
    history = [f"[{m['role']}] {shown(m, chat.calls) if m['role'] == 'assistant' else m['content']}"
               for m in episode.messages[:turn.message_index]]
    thinking, reply = episode.user_reaction(turn)
    return string.Template(template).substitute(
        history="\n\n".join(history) or "(nothing yet)",
        agent_message=shown(episode.messages[turn.message_index], chat.calls) or "(empty)",
        user_thinking=thinking or "(none)",
        user_reply=reply or "(the conversation ended)")


def _note(text: str | None) -> NoteResult:
    if text is None:
        return NoteResult(None, "reply without content")
    _, note = strip_thinking(text)
    return NoteResult(note) if note else NoteResult(None, "empty note")


class OpenAICoach:
    """The coach behind an OpenAI-compatible endpoint (a strong model, or the frozen simulator served by vLLM)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, timeout_s: float = 120, max_retries: int = 3, concurrency: int = 16):
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                                    max_retries=max_retries)
        self.model, self.max_tokens, self.temperature, self.concurrency = model, max_tokens, temperature, concurrency

    def notes_many(self, prompts: list[str]) -> list[NoteResult]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._note, prompts))

    def _note(self, prompt: str) -> NoteResult:
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=self.max_tokens,
                temperature=self.temperature)
        except openai.OpenAIError as error:
            return NoteResult(None, f"{type(error).__name__}: {error}")
        return _note(response.choices[0].message.content if response.choices else None)


class EngineCoach:
    """The coach sampled by a rollout engine (e.g. the policy's own engine: the agent coaching itself), in the
    engine's model's chat format."""

    def __init__(self, engine: RolloutEngine, chat, sampling: SamplingParams):
        self.engine, self.chat = engine, chat
        self.sampling = replace(sampling, stop_token_ids=chat.stop_token_ids)

    def notes_many(self, prompts: list[str]) -> list[NoteResult]:
        contexts = [self.chat.prompt([{"role": "user", "content": p}]) for p in prompts]
        return [_note(self.chat.read(g.text, "coach").text) for g in self.engine.generate(contexts, self.sampling)]


class ScriptedCoach:
    """Notes computed by ``fn(prompt) -> str | None`` (None: the coach failed): tests and the toy demo."""

    def __init__(self, fn: Callable[[str], str | None]):
        self.fn = fn

    def notes_many(self, prompts: list[str]) -> list[NoteResult]:
        return [NoteResult(None, "scripted failure") if (n := self.fn(p)) is None else _note(n) for p in prompts]


def teacher_context(chat, episode: AgentEpisode, turn_index: int, note: str) -> list[int]:
    """The student's context for the turn, rendered by the agent's chat format, with ``note`` appended to the
    system message."""
    turn = episode.turns[turn_index]
    return chat.context(episode.task, episode.messages[:turn.message_index], episode.agent_thinking, note=note)


def placebo_corrected(teacher: list[float], placebo: list[float], student: list[float]) -> list[float]:
    """l_teacher(note) - l_teacher(placebo note) + l_student per token: the gate then sees only what the note's
    content changes, not the shift any extra system text causes."""
    return [t - p + s for t, p, s in zip(teacher, placebo, student, strict=True)]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def gate_statistics(teacher: list[list[float]], student: list[list[float]], beta: float) -> dict:
    """Gate g = sigmoid(beta (l_teacher - l_student)) over the coached tokens at the sampling weights (the
    student's log-probs are the sampler's): what CSD will weigh before the update moves anything."""
    gates, gaps = [], []
    for t_row, s_row in zip(teacher, student, strict=True):
        for t, s in zip(t_row, s_row, strict=True):
            if t != NO_GATE:
                gaps.append(t - s)
                gates.append(_sigmoid(beta * (t - s)))
    if not gates:
        return {"csd_tokens": 0}
    return {"csd_tokens": len(gates), "csd_gate_mean": sum(gates) / len(gates),
            "csd_gate_open_frac": sum(g > 0.5 for g in gates) / len(gates),
            "csd_logprob_gap_mean": sum(gaps) / len(gaps)}

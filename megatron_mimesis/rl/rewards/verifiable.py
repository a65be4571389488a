"""SOUL-style verifiable rewards: the simulator's answer checked against the prompt's ``reference``.

The simulator speaks as the user, so its utterances are the transcript's role "user" messages; the graded answer
is its last one. A missing answer or an unusable reference is a scoring failure (value None), while an answer
that is present but wrong, ambiguous or unparseable scores 0.0: that is the policy's doing.
"""

import math
import re
import unicodedata
from abc import ABC, abstractmethod

from megatron_mimesis.rl.rewards.registry import RewardResult, register
from megatron_mimesis.rl.simulator.prompts import PromptRecord
from megatron_mimesis.rl.types import Episode

_LETTERS = "ABCDE"
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
# A bare answer ("B", "(B)", "B."), an announced one ("answer: B", "option (c)"), or a parenthesised one ("(B)").
_LETTER_PATTERNS = (
    re.compile(r"^\(?([A-E])\)?[.:)]?$"),
    re.compile(r"\b(?i:answer|option|choice)\s*(?:is|:)?\s*\(?([A-E])\b"),
    re.compile(r"\(([A-E])\)"),
)
_OPTION_LINE = re.compile(r"^\s*\(?([A-E])[).:]\s+(.+?)\s*$", re.MULTILINE)


def normalise(text: str) -> str:
    """Lowercase, drop punctuation and symbols, collapse whitespace: formatting never decides a match."""
    kept = "".join(" " if unicodedata.category(ch)[0] in "PS" else ch for ch in text.lower())
    return " ".join(kept.split())


def simulator_utterances(episode: Episode) -> list[str]:
    return [m["content"] for m in episode.transcript if m["role"] == "user"]


class VerifiableReward(ABC):
    """Scores the last simulator utterance with ``grade``; ``grade`` raises ValueError on an unusable reference."""

    @abstractmethod
    def grade(self, answer: str, episode: Episode, prompt: PromptRecord) -> tuple[float, dict]:
        """(reward, info) for the simulator's last utterance."""

    def score(self, episode: Episode, prompt: PromptRecord) -> RewardResult:
        utterances = simulator_utterances(episode)
        if not utterances:
            return RewardResult(None, error="no simulator utterance in the transcript")
        if prompt.reference is None:
            return RewardResult(None, error=f"prompt {prompt.id!r} has no reference")
        try:
            value, info = self.grade(utterances[-1], episode, prompt)
        except ValueError as e:
            return RewardResult(None, error=f"prompt {prompt.id!r}: {e}")
        return RewardResult(value, info)

    def score_batch(self, episodes: list[Episode], prompts: list[PromptRecord]) -> list[RewardResult]:
        return [self.score(e, p) for e, p in zip(episodes, prompts, strict=True)]


def _references(prompt: PromptRecord) -> list:
    """A list reference means several acceptable answers."""
    return prompt.reference if isinstance(prompt.reference, list) else [prompt.reference]


@register("exact_match")
class ExactMatch(VerifiableReward):
    def grade(self, answer, episode, prompt):
        got = normalise(answer)
        return float(any(got == normalise(str(ref)) for ref in _references(prompt))), {"answer": got}


def _listed_options(prompt_text: str) -> dict[str, str]:
    """Options listed in the prompt as lines like "B) Paris", "(B) Paris", "B. Paris" -> {"B": "paris"}."""
    return {letter: normalise(text) for letter, text in _OPTION_LINE.findall(prompt_text)}


def extract_choice(answer: str, options: dict[str, str]) -> str | None:
    """The single option letter the answer commits to: an explicit letter, else the one listed option whose text
    it contains. Several candidates or none -> None."""
    stripped = answer.strip()
    for pattern in _LETTER_PATTERNS:
        letters = {m.upper() for m in pattern.findall(stripped)}
        if len(letters) == 1:
            return letters.pop()
        if letters:
            return None
    text = f" {normalise(answer)} "
    hits = [letter for letter, option in options.items() if option and f" {option} " in text]
    return hits[0] if len(hits) == 1 else None


@register("choice")
class Choice(VerifiableReward):
    """Reference: the correct letter, or the correct option's text when the prompt lists the options."""

    def grade(self, answer, episode, prompt):
        options = _listed_options(prompt.prompt)
        ref = str(prompt.reference).strip()
        if ref.upper() in _LETTERS:
            want = ref.upper()
        else:
            matches = [letter for letter, text in options.items() if text == normalise(ref)]
            if len(matches) != 1:
                raise ValueError(f"choice reference {ref!r} is neither a letter A-E nor one listed option")
            want = matches[0]
        got = extract_choice(answer, options)
        return float(got == want), {"choice": got, "expected": want}


def extract_last_number(text: str) -> float | None:
    """The last number in the text; thousands separators are dropped ("1,234.5" -> 1234.5)."""
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None


@register("numeric")
class Numeric(VerifiableReward):
    def grade(self, answer, episode, prompt):
        try:
            want = float(prompt.reference)
        except (TypeError, ValueError):
            raise ValueError(f"numeric reference {prompt.reference!r} is not a number") from None
        got = extract_last_number(answer)
        ok = got is not None and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6)
        return float(ok), {"number": got, "expected": want}


@register("contains_target")
class ContainsTarget(VerifiableReward):
    """Toy CPU domain: 1.0 when any simulator utterance says the target word (case-insensitive, whole word)."""

    def grade(self, answer, episode, prompt):
        word = str(prompt.reference).strip()
        pattern = re.compile(rf"(?<!\w){re.escape(word)}(?!\w)", re.IGNORECASE)
        return float(any(pattern.search(u) for u in simulator_utterances(episode))), {"target": word}


@register("length_target")
class LengthTarget(VerifiableReward):
    """Toy CPU domain: 1 - |words - target| / target, clipped at 0, for the last simulator utterance."""

    def grade(self, answer, episode, prompt):
        target = prompt.reference
        if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
            raise ValueError(f"length_target reference must be a positive number, got {target!r}")
        words = len(answer.split())
        return max(0.0, 1.0 - abs(words - target) / target), {"words": words, "target": target}

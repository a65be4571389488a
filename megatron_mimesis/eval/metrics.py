"""Every metric of the table as a statistic of one row's per-position observations, with bootstrap intervals.

An observation is one held-out position seen from one row (a simulator, or the humans themselves): the features
of that row's turn there, the human's word count there, and, where measured, the turn's NLL, the judge's Turing
credit and behaviour labels. A metric is undefined (None, "n/a") when no observation carries what it needs.

A metric is a :class:`Statistic`: what one conversation contributes (``per_conversation``, computed once) and how
the contributions of a sample of conversations make the metric (``combine``). Confidence intervals resample
*conversations* (percentile bootstrap over rendering units, ``n`` replicates, seeded): turns of one conversation
are not independent, and resampling them alone would make the intervals too narrow. A conversation drawn k times
in a replicate counts as k conversations: its contribution enters the sample k times, so a per-conversation
metric (distinct-n, the τ-USI dimensions) never sees a repeated conversation as one longer one.
"""

import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import wasserstein_distance

from megatron_mimesis.eval import usi


@dataclass(frozen=True)
class Metric:
    name: str
    label: str  # the table's column header
    group: str  # likelihood | behaviour | judged | calibration
    what: str  # one line for the report


@dataclass(frozen=True)
class Statistic:
    per_conversation: Callable[[list[dict]], Any]  # one conversation's observations -> its contribution
    combine: Callable[[list[Any]], float | None]  # contributions of a sample of conversations -> the metric

    def __call__(self, obs: list[dict]) -> float | None:
        return self.combine([self.per_conversation(g) for g in conversations(obs)])


def pooled(fn: Callable[[list[dict]], float | None]) -> Statistic:
    """A metric of all the sample's observations together."""
    return Statistic(lambda group: group, lambda groups: fn([o for g in groups for o in g]))


def conversations(obs: list[dict]) -> list[list[dict]]:
    """Observations grouped by conversation (rendering unit), in order of first appearance."""
    units = defaultdict(list)
    for o in obs:
        units[o["unit"]].append(o)
    return list(units.values())


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def nll_per_token(obs):
    scored = [o for o in obs if o.get("nll") is not None]
    return _ratio(math.fsum(o["nll"] for o in scored), sum(o["tokens"] for o in scored))


def bits_per_byte(obs):
    scored = [o for o in obs if o.get("nll") is not None]
    total = _ratio(math.fsum(o["nll"] for o in scored), sum(o["bytes"] for o in scored))
    return None if total is None else total / math.log(2)


def length_distance(obs):
    """Earth mover's distance (in words) between this row's turn lengths and the humans' at the same positions."""
    spoken = [o for o in obs if o.get("words") is not None]
    if not spoken:
        return None
    return float(wasserstein_distance([o["words"] for o in spoken], [o["human_words"] for o in spoken]))


def _rate(field):
    def rate(obs):
        return _mean(float(o[field]) for o in obs if o.get(field) is not None)

    rate.__name__ = f"{field}_rate"
    return rate


def _distinct(field) -> Statistic:
    """Distinct n-grams / n-grams within each conversation, averaged over conversations: a per-conversation mean,
    so resampling conversations leaves it unbiased."""

    def ratio(group):
        grams = [g for o in group if o.get(field) is not None for g in o[field]]
        return len(set(grams)) / len(grams) if grams else None

    return Statistic(ratio, _mean)


def conversation_turns(group: list[dict]) -> tuple[int, int]:
    """(this row's, the human's) user turns in one conversation. Each position replays the human's context, so
    this row's conversation lasts to the first position where it ended, else as long as the human's data (the
    humans end at their last turn): a simulator that never ends is censored at the humans' lengths."""
    ended = next((k for k, o in enumerate(group, start=1) if o.get("ended")), None)
    return ended or len(group), len(group)


def turns_distance(pairs: list[tuple[int, int]]) -> float | None:
    return float(wasserstein_distance([p[0] for p in pairs], [p[1] for p in pairs])) if pairs else None


def mean_words(obs):
    return _mean(o.get("words") for o in obs)


def copy_rate(obs):
    return _mean(o.get("copy") for o in obs)


def turing_distance(obs):
    """|accuracy - 50| in points: 0 when the judge cannot tell this row from the humans, 50 when it always can."""
    accuracy = _mean(o.get("turing") for o in obs)
    return None if accuracy is None else abs(100.0 * accuracy - 50.0)


def dice(behaviour: str):
    """2|H & S| / (|H| + |S|) over positions: H where the human's turn shows the behaviour, S where this row's
    does. Undefined when neither ever shows it."""

    def score(obs):
        labelled = [o for o in obs if o.get("labels") is not None and o.get("human_labels") is not None]
        both = sum(behaviour in o["labels"] and behaviour in o["human_labels"] for o in labelled)
        total = sum(behaviour in o["labels"] for o in labelled) + sum(behaviour in o["human_labels"] for o in labelled)
        return _ratio(2.0 * both, total)

    return score


def usi_dimension(dimension: str) -> Statistic:
    """A τ-USI dimension (:mod:`.usi`): the Dice x 100 of the row's mean per-conversation features against the
    humans' at the same positions. Undefined for the humans' own row."""

    def pair(group):
        own = usi.conversation_features([o["usi"] for o in group])
        human = usi.conversation_features([o["human_usi"] for o in group])
        return None if own is None or human is None else (own, human)

    def combine(pairs):
        pairs = [p for p in pairs if p is not None]
        if not pairs:
            return None
        return usi.dimension_score(dimension, usi.feature_row([o for o, _ in pairs]),
                                   usi.feature_row([h for _, h in pairs]))

    return Statistic(pair, combine)


LIKELIHOOD = {
    Metric("nll_per_token", "NLL/token", "likelihood", "teacher-forced NLL of the human's turns, nats per token"):
        pooled(nll_per_token),
    Metric("bits_per_byte", "bits/byte", "likelihood", "the same NLL in bits per UTF-8 byte of the human's text"):
        pooled(bits_per_byte),
}
BEHAVIOUR = {
    Metric("length_distance", "length dist.", "behaviour", "earth mover's distance of turn lengths to the humans', "
                                                           "words"): pooled(length_distance),
    Metric("mean_words", "words/turn", "behaviour", "mean turn length in words"): pooled(mean_words),
    Metric("question_rate", "questions", "behaviour", "share of turns with a question mark"):
        pooled(_rate("question")),
    Metric("end_rate", "ends", "behaviour", "share of turns that end the conversation"): pooled(_rate("ended")),
    Metric("mean_turns", "turns/conv.", "behaviour", "user turns a conversation lasts, to the first that ends it"):
        Statistic(conversation_turns, lambda pairs: _mean(p[0] for p in pairs)),
    Metric("turns_distance", "turns dist.", "behaviour", "earth mover's distance of conversation lengths to the "
                                                         "humans', user turns"): Statistic(conversation_turns,
                                                                                           turns_distance),
    Metric("distinct_1", "distinct-1", "behaviour", "distinct words / words in a conversation's turns, mean over conversations"): _distinct("unigrams"),
    Metric("distinct_2", "distinct-2", "behaviour", "the same for word bigrams"):
        _distinct("bigrams"),
    Metric("copy_rate", "copying", "behaviour", "share of a turn's word bigrams found in the other side's last "
                                                "turn"): pooled(copy_rate),
    Metric("assistant_rate", "assistant-like", "behaviour", "share of turns with markdown lists/headers/bold, "
                                                            "service openers or sign-offs"):
        pooled(_rate("assistant_like")),
}
USI = {Metric(f"usi_{name}", f"{name[:2]} {usi.DIMENSION_NAMES[name]}", "usi",
              f"τ-USI {usi.DIMENSION_NAMES[name]} dimension: Dice x 100 of its features against the human turns"):
       usi_dimension(name) for name in usi.DIMENSIONS}
TURING = {Metric("turing_distance", "Turing dist.", "judged", "|judge accuracy at spotting the human - 50|, "
                                                              "points"): pooled(turing_distance)}


def dice_metrics(behaviours: list[str]) -> dict:
    return {Metric(f"dice_{b}", f"Dice {b}", "judged", f"Dice of the {b!r} label against the human turns"):
            pooled(dice(b)) for b in behaviours}


def bootstrap(obs: list[dict], metric: Statistic, n: int, seed: int) -> tuple[float | None, float | None, float | None]:
    """(value, 2.5th, 97.5th percentile) of ``metric`` with conversations resampled ``n`` times."""
    contributions = [metric.per_conversation(g) for g in conversations(obs)]
    value = metric.combine(contributions)
    if value is None or n == 0:
        return value, None, None
    rng = random.Random(seed)
    replicates = [v for v in (metric.combine(rng.choices(contributions, k=len(contributions))) for _ in range(n))
                  if v is not None]
    if not replicates:
        return value, None, None
    low, high = np.percentile(replicates, [2.5, 97.5])
    return value, float(low), float(high)

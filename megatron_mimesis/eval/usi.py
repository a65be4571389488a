"""τ-USI, the user-simulator index the MIMESIS paper reports: four behaviour dimensions and task calibration.

    τ-USI = (D1 + D2 + D3 + D4 + (1 - ECE) x 100) / 5

Each dimension is the Dice-Sørensen similarity 2 min(M, H) / (M + H) (1 when both are 0), x 100, averaged over
its features, between the simulator's feature row M and the humans' H; a row is the mean over conversations of
per-conversation features of the user turns. ECE is the difficulty-binned calibration of task success
(:func:`megatron_mimesis.eval.calibration.difficulty_ece`).

* D1 conversation: politeness, short messages (<= 3 words), formality (an em or en dash), acknowledgement-only
  turns, verbosity CV (std / mean of words per turn), repetition (a word trigram more than 10 times), identity
  confusion (writing like the agent);
* D2 information density: front-loading (words of the first two turns / all), identifiers per turn, words per
  turn, words of the opening turn;
* D3 clarification: uncertainty and certainty markers, pushback, clarification and information questions (a
  turn counts as the first of the three that matches);
* D4 error reaction: emotion, accusation, pivoting.

Source of the definitions. The MIMESIS repository's own ``usi_metric`` is not public; the public code of the
same metric (dimension names, features, patterns, Dice, bins and formula as the issue quotes them) is the
AgentArena leaderboard's ``analyze_interaction.compute_all_with_variance``, as ported line for line in OdysSim
(github.com/sunnweiwei/OdysSim, ``agents/tau_usi/usi_metric.py`` and ``utils.py``, Apache-2.0). The features and
their patterns below are those definitions. Two adaptations, because the evaluation here asks each simulator for
the user's turn at every human position of held-out conversations rather than rolling out whole episodes: a
simulator's "conversation" is its turns at one conversation's positions, compared with the human turns at the
same positions (the leaderboard compares whole rollouts on the same tasks); and there is one human row, not
three annotator batches, so no mean over batches (the intervals come from the bootstrap over conversations).
"""

import re
import statistics
from collections import Counter

SHORT_WORDS = 3
REPEAT_COUNT = 10  # a word trigram seen more than this often in one conversation's user turns is repetition

_PATTERNS = {
    "polite": r"\b(please|thank you|thanks|sorry|excuse me|appreciate|grateful|kind of you|wonderful|courteous|"
              r"considerate|i understand|no worries|my apologies|pardon)\b",
    "emotion": r"\b(frustrated|upset|angry|confused|worried|annoyed|furious|ridiculous|terrible|horrible|awful|ugh|"
               r"stressed|anxious|nervous|uncomfortable|panic|disappointed|disappointing|irritated|irritating|"
               r"aggravated|outraged|outrageous|exasperated|bothered|disgusted|miserable|devastated|heartbroken|"
               r"desperate)\b",
    "ids": r"(\b[a-z0-9]{6,}\b|#?\w*\d{5,}\w*|\w+_\w+_\d{3,}|gift_card_\w+|credit_card_\w+|paypal_\w+|\w+@\w+\.\w+)",
    "uncertainty": r"\b(i think|not sure|i don'?t remember|i don'?t recall|i believe|probably|maybe|i forgot|"
                   r"don'?t know|i guess|i'?m not sure|if i recall|i don'?t have|can'?t recall|can'?t find|"
                   r"i'?m unsure|i might|perhaps|apparently|sort of|kind of|somewhat|partly|possibly|vaguely|"
                   r"roughly|hesitant|doubtful|confused|uncertain|dunno)\b",
    "certainty": r"\b(definitely|absolutely|certainly|exactly|precisely|clearly|always|never|completely|entirely|"
                 r"fully|obvious|obviously|undoubtedly|without a doubt|for sure|of course|guaranteed|no doubt)\b",
    "pushback": r"\b(are you sure|that'?s (not right|wrong|incorrect|not what)|"
                r"i already (told|said|gave|provided|mentioned)|you already (asked|have)|try again|check again|"
                r"that can'?t be (right|correct)|that'?s (crazy|nonsense|ridiculous|absurd)|"
                r"this is (not fair|nonsense)|why (can'?t|won'?t|didn'?t|isn'?t|aren'?t|would)|"
                r"doesn'?t (seem|sound|look|make sense)|not what i (asked|said|meant|wanted)|"
                r"do(n'?t| not) ask me .* again|i would never)\b",
    "clarify": r"\b(what do you mean|what does that mean|what did you mean|could you (clarify|elaborate|specify)|"
               r"can you (explain|clarify|elaborate)|i don'?t understand|i dont understand|"
               r"what'?s the difference|whats the difference|what exactly|what specifically|"
               r"which (one|reservation|order|flight|option|plan|account|item|product) (is|was|do|should|did|would)|"
               r"i'?m not sure which|im not sure which|which is which|"
               r"you (said|mentioned|told me|wrote|indicated) .{0,30}\?|that mean|"
               r"what does that (involve|include|entail|look like)|(sorry|wait),? (what|which|how|i don'?t)|"
               r"can you (be more specific|give me more detail|break that down|walk me through)|"
               r"i'?m (confused|lost)|im (confused|lost)|"
               r"(how|what) (exactly|specifically) (does|do|is|are|would|will|should)|"
               r"could you (repeat|say) that|can you (repeat|say) that|"
               r"what (is|are) the (options|choices|alternatives|details)|"
               r"i need (more|some) (info|information|details|clarification)|"
               r"(so|wait),? (you'?re saying|does that mean|is that)|meaning\??|how so\??|in what (way|sense)\??)\b",
    "info": r"\b(what is (the|my)|what'?s (the|my)|how much|how many|when (will|does|is|can|did)|"
            r"where (is|are|was|can)|how (do|can|would|should) i|what are (the|my)|"
            r"can you (check|tell|find|look|see|show|help|list)|do you (have|know|see)|is (there|it|that) (a |any )?|"
            r"what options|how long|what.s the (status|price|cost|total|balance))\b",
    "accusation": r"\b(blame|fault|ridiculous|wrong|useless|incompetent|failure|misleading|irresponsible|"
                  r"unacceptable|disgrace|insult|scam|shame|stupid|trouble|disappointing|ruined)\b",
    "pivot": r"\b((wait|actually) (can|let|could|would)|i('?d| would) (like|prefer|rather)|(can you|can we|could you) "
             r"just|instead|rather than|how about|what about|what if|on second thought|"
             r"is there (a |any |another )?way to|(let'?s|can we|lets) (try|do|go with|switch|change)|"
             r"maybe (we|i|you) (should|could|can)|(change|switch|try) (it |that )?(to|something|a different))\b",
    "id_confuse": r"\b(how can i (help|assist)|how may i (help|assist)|what can i (do|help|assist) (for|with)|"
                  r"do you (want|require|wish|prefer)|would you (like|prefer)|"
                  r"let me (check|look|verify|find|pull up|search|assist|help)|"
                  r"i('?ll| will) (check|look into|verify|process|handle|assist|help)|"
                  r"i('?m| am) (happy|glad|here) to (help|assist)|is there anything else i can|"
                  r"thank you for (calling|contacting|reaching|choosing|your patience)|"
                  r"for (security|verification) (purposes|reasons)|(may|could) i (verify)|allow me to|permit me to|"
                  r"your (order|account|reservation|booking|request|ticket|case|inquiry)|i (see|understand) (that|your)|"
                  r"according to (our|the) (records|system|policy)|(our|the) (policy|system|records) (shows?|indicates?)|"
                  r"i (can|could) (offer|suggest|recommend)|(have you|did you) (tried?|considered?)|"
                  r"i apologize for (the|any) (inconvenience|confusion|delay|trouble))\b",
}
_RE = {name: re.compile(pattern) for name, pattern in _PATTERNS.items()}
_ACK_ONLY = re.compile(r"^(yes|yeah|yea|yep|yup|ok|okay|okey|sure|right|fine|great|perfect|awesome|cool|agree|agreed|"
                       r"correct|absolutely|indeed|alright|got it|go ahead|sounds good|that works|proceed|confirm|do it|"
                       r"no problem|thank you|thanks|please|mhm|uh-huh|aight)[\s!.\-,]*$")
_DASH = re.compile(r"[\u2014\u2013]")
QUESTION_KINDS = ("pushback", "clarify", "info")  # a turn is the first kind that matches

DIMENSIONS = {
    "D1_conv": ("politeness_rate", "short_msg_rate", "formality_rate", "ack_only_rate", "verbosity_cv", "repeat_rate",
                "id_confuse_rate"),
    "D2_info": ("info_frontload", "id_density", "user_words_per_turn", "opening_words"),
    "D3_clarif": ("uncertainty_rate", "certainty_rate", "pushback_q_rate", "clarify_q_rate", "info_q_rate"),
    "D4_react": ("emotion_rate", "accusation_rate", "pivot_rate"),
}
DIMENSION_NAMES = {"D1_conv": "conversation", "D2_info": "information density", "D3_clarif": "clarification",
                   "D4_react": "error reaction"}


def turn_signals(text: str) -> dict | None:
    """What one user turn contributes to its conversation's features; None for a turn with no text (a bare stop
    marker, which the definition leaves out)."""
    if not text.strip():
        return None
    lowered = text.lower()
    words = lowered.split()
    found = {name: bool(pattern.search(lowered)) for name, pattern in _RE.items() if name != "ids"}
    return {"words": len(words), **{name: found[name] for name in ("polite", "uncertainty", "certainty", "emotion",
                                                                    "accusation", "pivot", "id_confuse")},
            "formal": bool(_DASH.search(text)), "ack_only": bool(_ACK_ONLY.match(lowered.strip())),
            "ids": len(_RE["ids"].findall(lowered)),
            "question": next((kind for kind in QUESTION_KINDS if found[kind]), None),
            "trigrams": [" ".join(words[i:i + 3]) for i in range(len(words) - 2)]}


def conversation_features(turns: list[dict | None]) -> dict | None:
    """The per-conversation features of its user turns' signals (in order); None without a turn."""
    turns = [t for t in turns if t is not None]
    if not turns:
        return None
    n = len(turns)
    words = [t["words"] for t in turns]
    total, mean_words = sum(words), sum(words) / n

    def rate(key):
        return sum(bool(t[key]) for t in turns) / n

    trigrams = Counter(g for t in turns for g in t["trigrams"])
    return {
        "politeness_rate": rate("polite"), "short_msg_rate": sum(w <= SHORT_WORDS for w in words) / n,
        "formality_rate": rate("formal"), "ack_only_rate": rate("ack_only"),
        "verbosity_cv": statistics.pstdev(words) / mean_words if mean_words > 0 else 0.0,
        "repeat_rate": float(any(count > REPEAT_COUNT for count in trigrams.values())),
        "id_confuse_rate": float(any(t["id_confuse"] for t in turns)),
        "info_frontload": sum(words[:2]) / total if total else 0.0, "id_density": sum(t["ids"] for t in turns) / n,
        "user_words_per_turn": mean_words, "opening_words": float(words[0]),
        "uncertainty_rate": rate("uncertainty"), "certainty_rate": rate("certainty"),
        **{f"{kind}_q_rate": sum(t["question"] == kind for t in turns) / n for kind in QUESTION_KINDS},
        "emotion_rate": rate("emotion"), "accusation_rate": rate("accusation"), "pivot_rate": rate("pivot"),
    }


def feature_row(conversations: list[dict]) -> dict:
    """Mean of each feature over conversations."""
    return {key: sum(c[key] for c in conversations) / len(conversations) for key in conversations[0]}


def dice(m: float, h: float) -> float:
    m, h = abs(m), abs(h)
    return 2.0 * min(m, h) / (m + h) if m + h > 0 else 1.0


def dimension_score(dimension: str, simulator_row: dict, human_row: dict) -> float:
    features = DIMENSIONS[dimension]
    return 100.0 * sum(dice(simulator_row[f], human_row[f]) for f in features) / len(features)


def tau_usi(dimension_scores: list[float], ece: float) -> float:
    return (sum(dimension_scores) + (1.0 - ece) * 100.0) / (len(dimension_scores) + 1)

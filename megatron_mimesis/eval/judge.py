"""Judged metrics through any OpenAI-compatible chat endpoint: the pairwise Turing test and behaviour labels.

Turing test (SimulatorArena's protocol): the judge sees the conversation so far and two candidate next turns, the
human's and the simulator's, in an order drawn per position from the seed (so a resumed run asks the same
question), and rates 1-7 which one a person wrote (1 certainly A, 4 cannot tell, 7 certainly B). Picking the
human scores 1, picking the simulator 0, "cannot tell" 0.5; the row's accuracy is the mean, and the Turing
distance |accuracy - 50| is 0 for a simulator the judge cannot tell from a person.

Behaviour labels: the judge labels a single turn with the behaviours of a taxonomy file (YAML list of
``{name, description}``) it shows; the human turn at the same position is labelled the same way, and Dice per
behaviour compares the two.

Every verdict is cached (:class:`~megatron_mimesis.eval.cache.ResultCache`); a failed request or an answer
that does not parse is an error the evaluation counts and excludes, never a score.
"""

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import yaml

from megatron_mimesis.eval.cache import cache_key

TEMPLATES = Path(__file__).with_name("templates")
DEFAULT_TAXONOMY = Path(__file__).with_name("data") / "behaviours.yaml"
CONTEXT_TURNS = 8  # the judge sees at most the last 8 turns: enough to judge a reply, bounded prompt length
_RATING = re.compile(r"[1-7]")
_LIST = re.compile(r"\[.*?\]", re.S)


class TaxonomyError(ValueError):
    """A taxonomy file that cannot be used; the message names the file and entry."""


def load_taxonomy(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise TaxonomyError(f"--taxonomy {path}: no such file")
    try:
        entries = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise TaxonomyError(f"--taxonomy {path}: not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(entries, list) or not entries:
        raise TaxonomyError(f"--taxonomy {path}: expected a non-empty list of {{name, description}}")
    taxonomy = {}
    for i, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry["name"]
                and isinstance(entry.get("description"), str)):
            raise TaxonomyError(f"--taxonomy {path}: entry {i} needs a string name and description")
        if entry["name"] in taxonomy:
            raise TaxonomyError(f"--taxonomy {path}: entry {i} repeats the name {entry['name']!r}")
        taxonomy[entry["name"]] = entry["description"]
    return taxonomy


def render_context(context) -> str:
    shown = list(context)[-CONTEXT_TURNS:]
    speaker = {"user": "Person 1", "assistant": "Person 2", "system": "Setting"}
    lines = [f"{speaker[m['role']]}: {m['content']}" for m in shown]
    return "\n".join(lines) if lines else "(nothing yet: the next message opens the conversation)"


def human_first(seed: int, position_key: str, simulator: str) -> bool:
    """Whether the human's turn is candidate A for this position and simulator (a seeded coin)."""
    return random.Random(cache_key("order", seed, position_key, simulator)).random() < 0.5


def parse_rating(text: str) -> int | None:
    match = _RATING.search(text)
    return int(match.group()) if match else None


def turing_credit(rating: int, human_is_a: bool) -> float:
    if rating == 4:
        return 0.5
    return float((rating < 4) == human_is_a)


def parse_labels(text: str, taxonomy: dict[str, str]) -> list[str] | str:
    """The labels, or the reason the answer is unusable."""
    match = _LIST.search(text)
    if match is None:
        return "no JSON list in the answer"
    try:
        labels = json.loads(match.group())
    except json.JSONDecodeError:
        return "malformed JSON list"
    if not all(isinstance(label, str) for label in labels):
        return "labels are not strings"
    unknown = sorted(set(labels) - set(taxonomy))
    if unknown:
        return f"unknown behaviours {unknown}"
    return sorted(set(labels))


class Judge:
    def __init__(self, base_url: str, model: str, cache, taxonomy: dict[str, str] | None, seed: int,
                 timeout_s: float = 600, concurrency: int = 16):
        self.client = openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=timeout_s, max_retries=3)
        self.base_url = base_url
        self.model = model
        self.cache = cache
        self.taxonomy = taxonomy
        self.seed = seed
        self.concurrency = concurrency
        self.turing_template = (TEMPLATES / "turing_judge.txt").read_text()
        self.labels_template = (TEMPLATES / "behaviour_judge.txt").read_text()

    def _ask(self, prompt: str) -> dict:
        """{"answer": text} or {"error": reason}; cached by the request, so each question is asked once."""
        key = cache_key("judge", self.base_url, self.model, prompt)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}], temperature=0.0, max_tokens=64)
            content = response.choices[0].message.content if response.choices else None
            result = {"answer": content} if content is not None else {"error": "reply without content"}
        except openai.OpenAIError as error:
            return {"error": f"{type(error).__name__}: {error}"}  # not cached: a resumed run asks again
        self.cache.put(key, result)
        return result

    def turing(self, position, simulator: str, text: str) -> dict:
        """{"rating", "human_is_a", "credit"} or {"error"}."""
        human_is_a = human_first(self.seed, position.key, simulator)
        a, b = (position.human, text) if human_is_a else (text, position.human)
        prompt = self.turing_template.format(context=render_context(position.context), a=a, b=b)
        result = self._ask(prompt)
        if "error" in result:
            return result
        rating = parse_rating(result["answer"])
        if rating is None:
            return {"error": f"no rating 1-7 in the answer {result['answer'][:40]!r}"}
        return {"rating": rating, "human_is_a": human_is_a, "credit": turing_credit(rating, human_is_a)}

    def labels(self, position, text: str) -> dict:
        """{"labels": [...]} or {"error"}."""
        behaviours = "\n".join(f"- {name}: {description}" for name, description in self.taxonomy.items())
        prompt = self.labels_template.format(behaviours=behaviours, context=render_context(position.context),
                                             message=text, example=next(iter(self.taxonomy)))
        result = self._ask(prompt)
        if "error" in result:
            return result
        labels = parse_labels(result["answer"], self.taxonomy)
        return {"error": labels} if isinstance(labels, str) else {"labels": labels}

    def many(self, fn, *iterables) -> list[dict]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(fn, *iterables))

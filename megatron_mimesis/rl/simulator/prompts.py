"""RL prompt sources: JSONL prompt files and the seeded sampler that picks each step's prompts.

A record is one JSON object per line::

    {"id": str, "domain": str, "prompt": str, "opening"?: str,
     "reference"?: str | number | list, "behavior"?: {"name": str, "description": str}}

``prompt`` is the system/task prompt the simulator is given, ``opening`` an optional first assistant message,
``reference`` the answer verifiable rewards compare against, ``behavior`` the realistic behaviour (ABCD task) the
simulator is asked to enact. Every file is validated completely before training starts, so a typo in line 40 000
fails the launch rather than step 300.
"""

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_REQUIRED = ("id", "domain", "prompt")
_OPTIONAL = ("opening", "reference", "behavior")
_BEHAVIOR_KEYS = ("name", "description")


class PromptError(ValueError):
    """A prompt file is malformed; the message names ``file:line`` and the offending field."""


@dataclass(frozen=True)
class Behavior:
    name: str
    description: str


@dataclass(frozen=True)
class PromptRecord:
    id: str
    domain: str
    prompt: str
    opening: str | None = None
    reference: str | int | float | list | None = None
    behavior: Behavior | None = None


def _nonempty_str(value: object, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise PromptError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise PromptError(f"{where}: field '{field}' is empty")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _reference(value: object, where: str) -> str | int | float | list:
    if isinstance(value, str):
        return _nonempty_str(value, where, "reference")
    if _is_number(value):
        return value
    if isinstance(value, list):
        if not value:
            raise PromptError(f"{where}: field 'reference' is an empty list")
        for item in value:
            if not (isinstance(item, str) and item.strip()) and not _is_number(item):
                raise PromptError(f"{where}: field 'reference' list items must be non-empty strings or numbers")
        return value
    raise PromptError(f"{where}: field 'reference' must be a string, number or list, got {type(value).__name__}")


def _behavior(value: object, where: str) -> Behavior:
    if not isinstance(value, dict):
        raise PromptError(f"{where}: field 'behavior' must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_BEHAVIOR_KEYS))
    if unknown:
        raise PromptError(f"{where}: field 'behavior' has unknown keys {unknown}")
    for key in _BEHAVIOR_KEYS:
        if key not in value:
            raise PromptError(f"{where}: field 'behavior.{key}' is missing")
    return Behavior(*(_nonempty_str(value[key], where, f"behavior.{key}") for key in _BEHAVIOR_KEYS))


def _parse_record(line: str, where: str) -> PromptRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise PromptError(f"{where}: unknown fields {unknown} (allowed: {list(_REQUIRED + _OPTIONAL)})")
    for field in _REQUIRED:
        if field not in obj:
            raise PromptError(f"{where}: field '{field}' is missing")
    return PromptRecord(
        id=_nonempty_str(obj["id"], where, "id"),
        domain=_nonempty_str(obj["domain"], where, "domain"),
        prompt=_nonempty_str(obj["prompt"], where, "prompt"),
        opening=_nonempty_str(obj["opening"], where, "opening") if "opening" in obj else None,
        reference=_reference(obj["reference"], where) if "reference" in obj else None,
        behavior=_behavior(obj["behavior"], where) if "behavior" in obj else None,
    )


def load_prompts(paths: Iterable[str | Path]) -> list[PromptRecord]:
    """Read and validate every record of every file; ids must be unique across all files. Blank lines are
    skipped."""
    records: list[PromptRecord] = []
    seen: dict[str, str] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                record = _parse_record(line, where)
                if record.id in seen:
                    raise PromptError(
                        f"{where}: field 'id' duplicates id {record.id!r} first seen at {seen[record.id]}"
                    )
                seen[record.id] = where
                records.append(record)
    if not records:
        raise PromptError("no prompt records in the given files")
    return records


class DomainSampler:
    """Draws each step's prompts: a domain by weight, then the next record of that domain's shuffled order.

    Each domain walks its records in a fresh seeded shuffle per epoch, so no record repeats before all of its
    domain's records have been used. Every random choice is a pure function of (seed, counter), so the state is
    just counters and a resumed run draws exactly the prompts the uninterrupted run would have drawn.
    """

    def __init__(self, records: list[PromptRecord], weights: dict[str, float] | None, seed: int):
        self._by_domain: dict[str, list[PromptRecord]] = {}
        for record in records:
            self._by_domain.setdefault(record.domain, []).append(record)
        if not self._by_domain:
            raise ValueError("DomainSampler needs at least one record")
        self._domains = sorted(self._by_domain)
        if weights is None:
            weights = {d: float(len(self._by_domain[d])) for d in self._domains}
        if set(weights) != set(self._domains):
            raise ValueError(
                f"weights must name exactly the prompt domains {self._domains}; "
                f"missing {sorted(set(self._domains) - set(weights))}, unknown {sorted(set(weights) - set(self._domains))}"
            )
        if any(not math.isfinite(w) or w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0: {weights}")
        self._weights = [float(weights[d]) for d in self._domains]
        self._seed = seed
        self._draws = 0
        self._cursor = {d: [0, 0] for d in self._domains}  # domain -> [epoch, position in that epoch's order]
        self._orders: dict[tuple[str, int], list[int]] = {}

    def _order(self, domain: str, epoch: int) -> list[int]:
        key = (domain, epoch)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != domain}
            order = list(range(len(self._by_domain[domain])))
            random.Random(f"{self._seed}/order/{domain}/{epoch}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def sample(self, n: int) -> list[PromptRecord]:
        out = []
        for _ in range(n):
            rng = random.Random(f"{self._seed}/draw/{self._draws}")
            domain = rng.choices(self._domains, weights=self._weights)[0]
            self._draws += 1
            epoch, pos = self._cursor[domain]
            out.append(self._by_domain[domain][self._order(domain, epoch)[pos]])
            pos += 1
            if pos == len(self._by_domain[domain]):
                epoch, pos = epoch + 1, 0
            self._cursor[domain] = [epoch, pos]
        return out

    def state_dict(self) -> dict:
        return {
            "seed": self._seed,
            "draws": self._draws,
            "cursor": {d: list(c) for d, c in self._cursor.items()},
            "sizes": {d: len(rs) for d, rs in self._by_domain.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; refuses a state taken with another seed or another set of prompts, whose
        counters would silently point at different records."""
        if state["seed"] != self._seed:
            raise ValueError(f"sampler state has seed {state['seed']}, this sampler {self._seed}")
        sizes = {d: len(rs) for d, rs in self._by_domain.items()}
        if state["sizes"] != sizes:
            raise ValueError(f"sampler state was taken over domains/sizes {state['sizes']}, these prompts have {sizes}")
        self._draws = int(state["draws"])
        self._cursor = {d: [int(e), int(p)] for d, (e, p) in state["cursor"].items()}

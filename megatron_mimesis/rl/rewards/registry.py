"""Reward registry: names in the run config -> reward objects.

A reward scores finished episodes against their prompt records. ``RewardResult.value`` is ``None`` when scoring
failed (no answer to grade, judge down, unparseable verdict); such episodes are excluded from training and
counted, never given a made-up number.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from megatron_mimesis.rl.simulator.prompts import PromptRecord
from megatron_mimesis.rl.types import Episode


@dataclass
class RewardResult:
    value: float | None
    info: dict = field(default_factory=dict)
    error: str | None = None


class Reward(Protocol):
    def score(self, episode: Episode, prompt: PromptRecord) -> RewardResult: ...

    def score_batch(self, episodes: list[Episode], prompts: list[PromptRecord]) -> list[RewardResult]: ...


_REGISTRY: dict[str, Callable[..., Reward]] = {}


def register(name: str) -> Callable[[Callable[..., Reward]], Callable[..., Reward]]:
    """Register a reward factory (a class or function; its keyword arguments come from the run config)."""

    def decorator(factory: Callable[..., Reward]) -> Callable[..., Reward]:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def get_reward(name: str) -> Callable[..., Reward]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def rewards_for(domains_to_names: dict[str, str], options: dict[str, dict] | None = None) -> dict[str, Reward]:
    """Build each domain's reward from the config mapping. ``options[name]`` are the keyword arguments of reward
    ``name``'s factory (e.g. the judge section for "behaviour"). Domains sharing a reward name share one instance,
    so a judge's cache, connection pool and counters are shared too."""
    options = options or {}
    for name in [*domains_to_names.values(), *options]:
        get_reward(name)
    unused = sorted(set(options) - set(domains_to_names.values()))
    if unused:
        raise ValueError(f"options given for rewards no domain uses: {unused}")
    instances = {name: get_reward(name)(**options.get(name, {})) for name in sorted(set(domains_to_names.values()))}
    return {domain: instances[name] for domain, name in domains_to_names.items()}


class ThreadSafeCounters:
    """Named event counts bumped from worker threads (concurrent judge requests); read as a plain dict."""

    def __init__(self, *names: str):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(names, 0)

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

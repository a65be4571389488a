"""The tasks of agent RL's steps: the environment's train split in seeded epochs, per domain, with domains drawn by
their weight when the suite mixes several (UserRL's gyms); resumable from its state in the checkpoint.

Each domain walks its own tasks in epochs, a fresh seeded shuffle each, so every task of a domain comes once per
epoch of it; a mixture draws the domain of each task from its weights with a generator seeded by the run's seed and
the number of tasks drawn so far, so a resumed run draws exactly what the uninterrupted run would have. A suite of
one domain takes its tasks in order from that domain's epochs.
"""

import random

from megatron_mimesis.training.config import ConfigError


class _Epochs:
    def __init__(self, task_ids: list[str], seed):
        self.task_ids, self.seed = sorted(task_ids), seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[str]:
        order = list(self.task_ids)
        random.Random(self.seed * 100003 + self.epoch if isinstance(self.seed, int) else
                      f"{self.seed}/{self.epoch}").shuffle(order)
        return order

    def take(self, n: int) -> list[str]:
        out = []
        while len(out) < n:
            order = self._order()
            taken = order[self.position:self.position + n - len(out)]
            out += taken
            self.position += len(taken)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out


class TaskSampler:
    """``mixture``: the suite's train split, ``{domain: (task_ids, weight)}``."""

    def __init__(self, mixture: dict[str, tuple[list[str], float]], seed: int):
        mixture = {domain: (ids, weight) for domain, (ids, weight) in mixture.items() if ids}
        if not mixture:
            raise ConfigError("the environment's train split has no tasks")
        self.seed = seed
        self.domains = sorted(mixture)
        self.weights = [mixture[d][1] for d in self.domains]
        single = len(self.domains) == 1
        self.streams = {d: _Epochs(mixture[d][0], seed if single else f"{seed}/{d}") for d in self.domains}
        self.draws = 0

    def sample(self, n: int) -> list[str]:
        if len(self.domains) == 1:
            return self.streams[self.domains[0]].take(n)
        out = []
        for _ in range(n):
            (domain,) = random.Random(f"{self.seed}/draw/{self.draws}").choices(self.domains, self.weights)
            out += self.streams[domain].take(1)
            self.draws += 1
        return out

    def state_dict(self) -> dict:
        return {"draws": self.draws,
                "domains": {d: {"epoch": s.epoch, "position": s.position} for d, s in self.streams.items()}}

    def load_state_dict(self, state: dict) -> None:
        if "domains" not in state:  # a checkpoint from before mixtures: one domain's epoch and position
            state = {"draws": 0, "domains": {self.domains[0]: state}}
        if set(state["domains"]) != set(self.domains):
            raise ConfigError(f"the checkpoint's task sampler walked the domains {sorted(state['domains'])}, this run "
                              f"samples {self.domains}: resume with the same env_options, or start from the "
                              f"checkpoint with --finetune")
        self.draws = state["draws"]
        for domain, position in state["domains"].items():
            self.streams[domain].epoch, self.streams[domain].position = position["epoch"], position["position"]

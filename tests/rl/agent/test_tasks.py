"""The task sampler: one domain walks its seeded epochs as before mixtures; a mixture draws domains by weight, each
domain cycling through its own tasks; a resumed sampler draws what the uninterrupted one would."""

import random
from collections import Counter

import pytest

from megatron_mimesis.rl.agent.tasks import TaskSampler
from megatron_mimesis.training.config import ConfigError


def test_one_domain_walks_seeded_epochs():
    ids = [f"t{i}" for i in range(5)]
    sampler = TaskSampler({"toy": (ids, 1.0)}, seed=7)
    epochs = []
    for epoch in range(3):  # sorted ids, shuffled by seed * 100003 + epoch: the order of every run so far
        order = sorted(ids)
        random.Random(7 * 100003 + epoch).shuffle(order)
        epochs += order
    assert sampler.sample(4) + sampler.sample(4) + sampler.sample(7) == epochs
    assert sampler.state_dict() == {"draws": 0, "domains": {"toy": {"epoch": 3, "position": 0}}}


def test_a_mixture_draws_domains_by_weight_and_resumes_where_it_was():
    mixture = {"FunctionGym": ([f"f{i}" for i in range(4)], 3.0), "TurtleGym": ([f"s{i}" for i in range(50)], 1.0)}
    sampler = TaskSampler(mixture, seed=1)
    drawn = sampler.sample(4000)
    share = Counter(t[0] for t in drawn)["f"] / len(drawn)
    assert 0.72 < share < 0.78  # 3 : 1
    functions = [t for t in drawn if t.startswith("f")]
    assert all(sorted(functions[k:k + 4]) == mixture["FunctionGym"][0] for k in range(0, 400, 4))  # whole epochs
    first, state = TaskSampler(mixture, seed=1), None
    first.sample(37)
    state = first.state_dict()
    resumed = TaskSampler(mixture, seed=1)
    resumed.load_state_dict(state)
    assert resumed.sample(100) == first.sample(100) == drawn[37:137]
    assert TaskSampler(mixture, seed=2).sample(50) != drawn[:50]


def test_old_states_load_and_other_domains_are_refused():
    sampler = TaskSampler({"toy": (["a", "b", "c"], 1.0)}, seed=0)
    sampler.load_state_dict({"epoch": 2, "position": 1})  # a checkpoint of before mixtures
    assert sampler.state_dict()["domains"]["toy"] == {"epoch": 2, "position": 1}
    with pytest.raises(ConfigError, match=r"walked the domains \['toy'\], this run samples \['a', 'b'\]"):
        TaskSampler({"a": (["x"], 1.0), "b": (["y"], 1.0)}, seed=0).load_state_dict(sampler.state_dict())
    with pytest.raises(ConfigError, match="train split has no tasks"):
        TaskSampler({"a": ([], 1.0)}, seed=0)

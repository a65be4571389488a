"""The preflight of the endpoints a run calls: each config's endpoints, and each way one can fail to answer, as the
one line that refuses the run."""

import re

import pytest

from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.training.config import ConfigError, TrainConfig
from megatron_mimesis.training.endpoints import Endpoint, check_endpoints
from tests.rl.fakes import FakeOpenAIServer

PLACEHOLDER = "http://COACH_HOST:8000/v1"  # as the shipped agent configs name the coach until edited


def test_each_config_names_the_endpoints_it_calls():
    assert TrainConfig().endpoints() == []
    agent = AgentRLConfig(user_model_options={"base_url": "http://sim/v1", "model": "sim"},
                          coach_options={"base_url": "http://coach/v1", "model": "c", "api_key": "k"})
    assert agent.endpoints() == [Endpoint("user_model_options", "http://sim/v1", "sim"),
                                 Endpoint("coach_options", "http://coach/v1", "c", "k")]
    assert agent.replace(coach="scripted", coach_options={"note": "x"}).endpoints() == agent.endpoints()[:1]
    judge = {"base_url": "http://judge/v1", "model": "j"}
    simulator = SimulatorRLConfig(counterpart_options={"base_url": "http://cp/v1", "model": "cp"},
                                  domain_rewards={"abcd": "behaviour", "soul": "exact_match"},
                                  reward_options={"behaviour": {"judge": judge}, "unused": {"judge": judge}})
    assert simulator.endpoints() == [Endpoint("counterpart_options", "http://cp/v1", "cp"),
                                     Endpoint("reward_options.behaviour.judge", "http://judge/v1", "j")]


def test_an_endpoint_that_serves_the_model_passes_and_every_other_is_one_line():
    with FakeOpenAIServer(models=["sim"], api_key="secret") as server:
        check_endpoints([Endpoint("user_model_options", server.base_url, "sim", "secret")] * 3)
        assert server.requests == []  # a model list, asked once: no completion was requested
        with pytest.raises(ConfigError) as refused:
            check_endpoints([Endpoint("coach_options", server.base_url, "COACH_MODEL", "secret")])
        assert str(refused.value) == f"coach_options: {server.base_url} serves ['sim'], not the model 'COACH_MODEL'"
        with pytest.raises(ConfigError) as refused:
            check_endpoints([Endpoint("user_model_options", server.base_url, "sim")])
        assert str(refused.value) == f"user_model_options: {server.base_url}/models answered HTTP 401 (its api_key?)"
    for url in (PLACEHOLDER, "http://127.0.0.1:9/v1"):  # a name that resolves nowhere, a port nothing listens on
        with pytest.raises(ConfigError) as refused:
            check_endpoints([Endpoint("coach_options", url, "m")])
        assert re.fullmatch(rf"coach_options: {re.escape(url)}/models did not answer \(.+\); the run would call it "
                            r"at every step", str(refused.value)), refused.value

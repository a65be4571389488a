"""tau2 mock-domain episodes end to end through the agent runner: a scripted agent that does the task earns
tau2's reward 1.0 and one that does not earns 0.0; the tiny megatron model as the agent runs a whole episode
(rendered tau2 policy and tools, local engine, scripted user) that tau2's evaluator scores."""

import torch
from transformers import AutoTokenizer

from megatron_mimesis.rl.agent.agent_chat import PiecewiseAgentChat
from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner, score_episodes
from megatron_mimesis.rl.agent.user_models import ScriptedUserModel
from megatron_mimesis.rl.envs.tau2 import Tau2Suite
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.fakes import ScriptedEngine

UPDATE = ("<tool_call>\n<function=update_task_status>\n<parameter=task_id>\ntask_1\n</parameter>\n"
          "<parameter=status>\ncompleted\n</parameter>\n</function>\n</tool_call>")


def _user():
    """Asks once for task_1 to be completed, stops at the agent's next message."""
    def reply(instructions, transcript):
        if sum(m["role"] == "user" for m in transcript) == 0:
            return "I want task_1 done.", "Please mark task_1 as completed."
        return "Whatever happened, I am leaving.", "Thanks. <END>"

    return ScriptedUserModel(reply)


def test_scripted_agents_score_tau2_rewards(tiny_dataset):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")
    engine = ScriptedEngine(tokenizer, [[UPDATE, "Sorry, I cannot do that."], ["Done, task_1 is completed."]])
    runner = AgentEpisodeRunner(engine, PiecewiseAgentChat(tokenizer, thinking=False), _user(), SamplingParams(),
                                max_agent_turns=4)
    solved, refused = runner.run(Tau2Suite("mock"), ["update_task_1"], rollouts_per_task=2, step_seed=0)
    assert score_episodes([solved, refused]) == {}
    assert solved.termination == refused.termination == "user_stop"
    assert solved.turn_rewards == [0.0, 1.0] and solved.score_info["reward"] == 1.0
    assert refused.turn_rewards == [0.0] and refused.score_info["reward"] == 0.0
    # the agent's prompt was tau2's policy and tools, in the Qwen3.5 tool format
    context = tokenizer.decode(engine.calls[0][0][0])
    assert "update_task_status" in context and "<tools>" in context and "Hi! How can I help you today?" in context


def test_tiny_model_agent_runs_a_mock_episode_scored_by_tau2(tiny_dataset, tiny_hf_checkpoint):
    from megatron_mimesis.models.config import ParallelConfig
    from megatron_mimesis.models.hf_io import LazyHFState
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.rl.engines.local import LocalEngine
    from tests.models.harness import build_megatron_from_hf, init_single_process_megatron
    from tests.training.conftest import VOCAB

    tokenizer = AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")
    init_single_process_megatron()
    model, _, _ = build_megatron_from_hf(LazyHFState(tiny_hf_checkpoint), ParallelConfig(),
                                         preset=get_preset("tiny").replace(vocab_size=VOCAB))
    engine = LocalEngine(model, tokenizer, torch.device("cpu"))
    runner = AgentEpisodeRunner(engine, PiecewiseAgentChat(tokenizer, thinking=False), _user(),
                                SamplingParams(max_new_tokens=6, seed=1), max_agent_turns=2)
    (episode,) = runner.run(Tau2Suite("mock"), ["update_task_1"], rollouts_per_task=1, step_seed=0)
    assert 1 <= len(episode.turns) <= 2 and all(len(t.response_ids) <= 6 for t in episode.turns)
    assert score_episodes([episode]) == {}
    assert episode.turn_rewards is not None and len(episode.turn_rewards) == len(episode.turns)
    assert episode.score_info["reward"] == 0.0  # six random tokens do not complete a task
    assert episode.score_info["termination"] in ("user_stop", "max_steps")

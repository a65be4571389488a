"""UserRL's gyms with the tiny simulator served by real vLLM as their user and judge, through the run's per-episode
proxy (collected by ``tests/checkpoint/test_served_simulator.py``, whose module-scoped ``server`` they share: a vLLM
start and an export cost a minute or two of CPU): TelepathyGym's judge held by vLLM's structured outputs to a thought and the JSON the gym parses (the proxy
keeps the thought, the gym gets the JSON), and agent RL on a mixture of FunctionGym and TelepathyGym with CSD on,
each gym's metrics logged, the coach's prompts built from the thoughts the proxy kept, and a requeue resumed from
the checkpoint. The agent is the tiny model taught, by a few plain steps of supervised learning here, to call the
gyms' tool (a random model never writes a call)."""

import json

import pytest
import torch

from megatron_mimesis.rl.agent.agent_chat import PiecewiseAgentChat
from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner, score_episodes
from megatron_mimesis.rl.agent.tasks import TaskSampler
from megatron_mimesis.rl.envs import build_suite
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.envs.test_userrl import call
from tests.rl.fakes import ScriptedEngine
from tests.training.conftest import read_metrics, run_trainer

GYMS_MISSING = "UserRL's gyms: make venv-vllm installs them from ../shared/third_party"

# a short thought, the end of thinking, then one JSON object that both of TelepathyGym's prompts parse (a question
# reads "response"; a guess "judgment" and "feedback")
JUDGE = (r'[a-z]{1,8}( [a-z]{1,8}){0,3}</think>\{"thought": "[a-z ]{0,12}", "response": "(Yes|No|Maybe)", '
         r'"judgment": "(Yes|No)", "feedback": "[a-z]{1,8}( [a-z]{1,8}){0,2}"\}')
GYMS = {"gyms": {"FunctionGym": {"weight": 1},
                 "TelepathyGym": {"weight": 1, "config": {"temperature": 1.0},
                                  "request_fields": {"structured_outputs": {"regex": JUDGE}, "max_tokens": 96}}},
        "max_steps": 4, "timeout_s": 300, "concurrency": 4}
TARGETS = {"FunctionGym": call("action", "1 2 3 4"), "TelepathyGym": call("answer", "a person")}


def test_telepathy_gym_is_judged_by_the_served_simulator_through_the_proxy(server, tiny_dataset):
    pytest.importorskip("telepathygym", reason=GYMS_MISSING)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")
    suite = build_suite("userrl", GYMS).connect(server.base_url, "tiny")
    engine = ScriptedEngine(tokenizer, [[call("action", "Is it a person?")] * 2, [call("answer", "Albert Einstein")] * 2])
    runner = AgentEpisodeRunner(engine, PiecewiseAgentChat(tokenizer, thinking=False), None, SamplingParams(), 2)
    episodes = runner.run(suite, ["TelepathyGym/entity_001"], rollouts_per_task=2, step_seed=0)
    assert score_episodes(episodes) == {}
    for episode in episodes:
        answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert answers[0].split("\n")[0] in ("Yes", "No", "Maybe"), answers  # the gym parsed the judge's JSON
        thoughts = [episode.user_thinking[i] for i, m in enumerate(episode.messages) if m["role"] == "tool"]
        assert all(t and "</think>" not in t and "{" not in t for t in thoughts), thoughts  # kept, never shown
        assert all("</think>" not in a and "thought" not in a for a in answers)
        assert episode.turn_rewards[1] in (0.0, 1.0) and episode.score_info["user_requests"] == 2
    assert suite.user_proxy().statistics()["failures"] == 0
    suite.close()


@pytest.fixture(scope="module")
def agent(tiny_hf_checkpoint, tiny_dataset, server, tmp_path_factory):
    """The tiny model after 200 steps of next-token loss on the tool call each gym's opening asks for here; it then
    writes that call, greedily, after an opening of each gym."""
    pytest.importorskip("telepathygym", reason=GYMS_MISSING)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")
    chat = PiecewiseAgentChat(tokenizer, thinking=False)
    suite = build_suite("userrl", GYMS).connect(server.base_url, "tiny")
    examples = []
    for gym, (task_ids, _) in suite.mixture("train").items():
        for task_id in task_ids[:3]:
            env = suite.make(task_id)
            opening = env.open(seed=0).text
            context = chat.context(env.task, [{"role": "user", "content": opening}])
            target = tokenizer.encode(TARGETS[gym], add_special_tokens=False) + [chat.stop_token_ids[0]]
            examples.append((context, target))
    suite.close()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(200):
        context, target = examples[step % len(examples)]
        ids = torch.tensor([context + target])
        labels = torch.tensor([[-100] * len(context) + target])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        for context, target in examples[:1] + examples[-1:]:
            written = model.generate(torch.tensor([context]), max_new_tokens=len(target), do_sample=False)
            assert written[0, len(context):].tolist() == target, tokenizer.decode(written[0, len(context):])
    out = tmp_path_factory.mktemp("agent") / "hf"
    model.save_pretrained(out)
    return out


def _args(server, agent, tiny_dataset, work, *extra):
    return ["--tokenizer", str(tiny_dataset / "tokenizer"), "--env", "userrl", "--env-options", json.dumps(GYMS),
            "--user-model", "openai", "--user-model-options", json.dumps({"base_url": server.base_url, "model": "tiny"}),
            "--coach", "scripted", "--coach-options", json.dumps({"note": "Ask before you guess."}), "--no-thinking",
            "--model-overrides", json.dumps({"vocab_size": 512}), "--pretrained-hf", str(agent),
            "--tasks-per-step", "2", "--rollouts-per-prompt", "2", "--max-agent-turns", "1", "--max-new-tokens", "104",
            "--temperature", "0.3", "--csd-alpha", "0.5", "--csd-log-samples", "16", "--lr", "1e-4", "--min-lr", "1e-4", "--seed", str(SEED),
            "--train-iters", "2", "--save", str(work / "checkpoints"), "--save-interval", "10",
            "--log-dir", str(work / "log"), *extra]


SEED = 1  # both of its first two steps draw a task of each gym


def test_agent_rl_on_two_gyms_with_csd_resumes_after_a_requeue(server, agent, tiny_dataset, tmp_path):
    suite = build_suite("userrl", GYMS)
    sampler = TaskSampler(suite.mixture("train"), SEED)
    steps = [sampler.sample(2) for _ in range(2)]
    assert [{t.split("/")[0] for t in tasks} for tasks in steps] == [{"FunctionGym", "TelepathyGym"}] * 2
    # a scheduled stop after step 1 saves it and exits for requeue; the requeued job resumes there
    run_trainer(1, *_args(server, agent, tiny_dataset, tmp_path, "--exit-interval", "1"),
                module="megatron_mimesis.rl.agent_rl", timeout=900)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "1"
    run_trainer(1, *_args(server, agent, tiny_dataset, tmp_path), module="megatron_mimesis.rl.agent_rl", timeout=900)
    records = read_metrics(tmp_path / "log")
    assert [r["iteration"] for r in records] == [1, 2]
    for record, tasks in zip(records, steps, strict=True):
        drawn = {task.split("/")[0] for task in tasks}
        assert {key.split("/")[0] for key in record if key.endswith("/rollouts")} == drawn, (record, tasks)
        for gym in drawn:
            assert record[f"{gym}/rollouts"] == 2 * sum(t.startswith(gym) for t in tasks)
            assert f"{gym}/reward_mean" in record and f"{gym}/turns_mean" in record and record[f"{gym}/errors"] == 0
        assert record["rows"] > 0 and record["csd_turns"] == record["rows"] and record["coach_failures"] == 0
    samples = [json.loads(line) for line in (tmp_path / "log" / "csd_samples.jsonl").read_text().splitlines()]
    assert {s["task"] for s in samples if s["step"] == 1} == set(steps[1])  # the resumed run drew step 2's tasks
    # the coach's prompt held the simulator's thought the proxy kept, where the agent asked TelepathyGym's user
    judged = [s for s in samples if s["task"].startswith("TelepathyGym") and s["user_reply"]]
    assert judged and all(s["user_thinking"] and "</think>" not in s["user_thinking"] for s in judged)
    assert sum(r.get("user_requests", 0) for r in records) >= len(judged)

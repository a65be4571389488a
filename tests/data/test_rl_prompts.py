"""``python -m data_prep.rl_prompts`` on task files made from UserRL's own task data (``../shared/third_party``):
SearchGym's questions (a text answer), FunctionGym's functions (a number), IntentionGym's missing details (one of
listed options) and TauGym's tau-bench customer tasks (no answer: behaviour tasks). Each record is read by the
trainer's reader and scored by the reward its domain gets: the task's answer scores 1, another 0; the behaviour
judge is shown the behaviour the prompt asked for. The shipped simulator-RL config trains on the result."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data_prep.pipeline import PrepError
from data_prep.rl_prompts import NEUTRAL, build
from megatron_mimesis.rl.rewards.behaviour import judge_messages
from megatron_mimesis.rl.rewards.registry import get_reward
from megatron_mimesis.rl.simulator.prompts import load_prompts
from megatron_mimesis.rl.types import Episode
from tests.training.conftest import read_metrics, run_trainer

GYMS = Path(__file__).resolve().parents[3] / "shared" / "third_party" / "UserRL" / "gyms"
PER_GYM = 12
BEHAVIOURS = [{"name": "impatient", "description": "wants it done now and pushes when the assistant is slow"},
              {"name": "vague", "description": "gives details only when asked, and loosely"},
              {"name": "changes_mind", "description": "switches what they want once, midway"}]


def gym_data(gym: str, name: str):
    return json.loads((GYMS / gym / gym.lower() / "data" / name).read_text())


def userrl_tasks() -> dict[str, list[dict]]:
    """Two task files in the builder's format: ``soul`` (the verifiable gyms) and ``abcd`` (TauGym's tasks)."""
    search = [{"id": q["id"], "domain": "soul_search", "instructions": f"You want to know: {q['question']}",
               "answer": q["answer"]} for q in gym_data("SearchGym", "questions.json")[:PER_GYM]]
    function = [{"id": f["id"], "domain": "soul_function",
                 "instructions": f"You have a hidden rule f(a, b, c, d) = {f['rule']}. Ask the assistant what "
                                 f"f{tuple(f['test_case'])} is.", "answer": f["expected_result"]}
                for f in gym_data("FunctionGym", "functions.json")[:PER_GYM]]
    intention = [{"id": i["id"], "domain": "soul_intention",
                  "instructions": f"{i['task']} {i['missing_details'][0]['description']}: you prefer "
                                  f"{i['missing_details'][0]['options'][-1]}.",
                  "answer": i["missing_details"][0]["options"][-1], "options": i["missing_details"][0]["options"]}
                 for i in gym_data("IntentionGym", "all_intentions_train.json")[:PER_GYM]]
    tau = [{"domain": "abcd", "instructions": t["info"]["task"]["instruction"]}
           for t in gym_data("TauGym", "tau_train.json")[:PER_GYM]]
    return {"soul": search + function + intention, "abcd": tau}


def write_tasks(directory: Path, files: dict[str, list]) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    for name, tasks in files.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return [str(directory / f"{name}.jsonl") for name in files]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl-prompts")
    tasks = userrl_tasks()
    bad = [{**tasks["soul"][0], "id": "cut"} | {"answer": ""},  # empty answer
           {**tasks["soul"][-1], "id": "not-an-option", "answer": "Somewhere else"},
           {**tasks["soul"][PER_GYM], "id": "mixed", "answer": "225"},  # a text answer in a numeric domain
           tasks["abcd"][0]]  # the same task twice: the same content id
    (tmp / "behaviours.jsonl").write_text("".join(json.dumps(b) + "\n" for b in BEHAVIOURS))
    inputs = write_tasks(tmp / "in", {"soul": tasks["soul"] + bad[:3], "abcd": tasks["abcd"] + bad[3:]})
    manifest = build(inputs, str(tmp / "out"), str(tmp / "behaviours.jsonl"), on_error="skip")
    return tasks, manifest, tmp


def episode(record, last: str) -> Episode:
    return Episode(record.id, record.domain, 0, 0, transcript=[{"role": "user", "content": "Hi."},
                                                               {"role": "assistant", "content": "Here it is."},
                                                               {"role": "user", "content": last}])


def test_each_record_is_scored_by_its_domains_reward_against_the_tasks_answer(built):
    tasks, manifest, _ = built
    assert manifest["domain_rewards"] == {"abcd": "behaviour", "soul_function": "numeric",
                                          "soul_intention": "choice", "soul_search": "exact_match"}
    soul, abcd = manifest["files"]["soul"], manifest["files"]["abcd"]
    assert (soul["documents_in"], soul["records"]) == (3 * PER_GYM + 3, 3 * PER_GYM)
    assert soul["skipped"] == {"empty_content": 1, "bad_answer": 1, "mixed_domain": 1}
    assert (abcd["records"], abcd["skipped"]) == (PER_GYM, {"duplicate_id": 1})
    records = {r.id: r for r in load_prompts([soul["path"], abcd["path"]])}
    rewards = {domain: get_reward(name)() for domain, name in manifest["domain_rewards"].items() if name != "behaviour"}
    scored = Counter()
    for task in tasks["soul"]:
        record = records[task["id"]]
        said = task["answer"] if isinstance(task["answer"], str) else f"So it is {task['answer']:g}."
        right, wrong = (rewards[record.domain].score(episode(record, text), record) for text in (said, "No idea."))
        assert (right.value, wrong.value) == (1.0, 0.0), (record, right, wrong)
        scored[record.domain] += 1
    assert scored == {"soul_search": PER_GYM, "soul_function": PER_GYM, "soul_intention": PER_GYM}
    intention = next(r for r in records.values() if r.domain == "soul_intention")
    letter = intention.reference  # the option's letter, in the prompt as "<letter>) <option>"
    assert rewards["soul_intention"].score(episode(intention, f"({letter})"), intention).value == 1.0


def test_behaviour_tasks_share_the_behaviours_with_a_neutral_third(built):
    tasks, manifest, tmp = built
    abcd = [r for r in load_prompts([manifest["files"]["abcd"]["path"]])]
    given = Counter(r.behavior.name for r in abcd)
    assert given[NEUTRAL["name"]] == round(PER_GYM / 3) == 4
    assert sorted(v for k, v in given.items() if k != NEUTRAL["name"]) == [2, 3, 3]  # 8 tasks, 3 behaviours in turn
    assert manifest["files"]["abcd"]["behaviours"] == dict(sorted(given.items()))
    for record, task in zip(abcd, tasks["abcd"], strict=True):  # the order of the task file
        assert task["instructions"].strip() in record.prompt and record.reference is None
        judged = judge_messages(episode(record, "Fine."), record)[0]["content"]
        assert f"Behaviour: {record.behavior.name}\nDescription: {record.behavior.description}" in judged
    again = build([str(tmp / "in" / "abcd.jsonl")], str(tmp / "again"), str(tmp / "behaviours.jsonl"),
                  on_error="skip")  # alone: the same ids (the tasks' content) and behaviours (the seed's)
    assert (tmp / "again" / "abcd.jsonl").read_bytes() == Path(manifest["files"]["abcd"]["path"]).read_bytes()
    assert again["domain_rewards"] == {"abcd": "behaviour"}


def test_a_bad_task_stops_the_build_naming_its_line(tmp_path):
    tasks = userrl_tasks()["soul"][:3]
    inputs = write_tasks(tmp_path, {"soul": [*tasks, {**tasks[0], "id": "x", "answer": ["madison", ""]}]})
    done = subprocess.run([sys.executable, "-m", "data_prep.rl_prompts", "--input", *inputs, "--output",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and not (tmp_path / "out" / "manifest.json").exists()
    assert done.stderr.strip() == (f"error: {inputs[0]}:4: answer: a list of answers must be non-empty strings or "
                                   "numbers [bad_answer] (--on-error skip leaves such tasks out and counts them)")
    inputs = write_tasks(tmp_path, {"abcd": userrl_tasks()["abcd"][:2]})
    with pytest.raises(PrepError, match=r"^2 tasks of domain\(s\) \['abcd'\] have no answer, so they are behaviour "
                                        r"tasks: give --behaviours"):
        build(inputs, str(tmp_path / "out"))


@pytest.mark.slow
def test_the_shipped_simulator_rl_config_trains_on_them(built, tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """``launch/configs/rl_simulator_9b.yaml`` at the tiny size on the built records, its counterpart and behaviour
    judge an OpenAI-compatible stand-in: every domain's reward comes back for the rollouts drawn."""
    from tests.rl.fakes import FakeOpenAIServer

    _, manifest, _ = built
    verdict = {"e": 0.5, "p": 0.5, "n": 1.0, "c": 1.0, "described_instead_of_enacted": False}

    def reply(messages):
        judging = messages[-1]["content"].startswith("You are evaluating a simulated user")
        return json.dumps(verdict) if judging else "Could you tell me more?"

    with FakeOpenAIServer(reply=reply, models=["assistant", "judge"]) as server:
        endpoint = {"base_url": server.base_url, "model": "assistant", "max_tokens": 16, "concurrency": 4}
        judge = {"judge": {"base_url": server.base_url, "model": "judge", "concurrency": 4, "timeout_s": 30,
                           "cache_dir": str(tmp_path / "judge-cache")}}
        run_trainer(1, "--config", "launch/configs/rl_simulator_9b.yaml", "--model", "tiny", "--load", "", "--no-finetune",
                    "--pretrained-hf", str(tiny_hf_checkpoint), "--tokenizer", str(tiny_dataset / "tokenizer"),
                    "--model-overrides", json.dumps({"vocab_size": 512}), "--engine", "local", "--no-thinking",
                    "--tensor-model-parallel-size", "1", "--no-sequence-parallel", "--no-bf16",
                    "--prompts", json.dumps([f["path"] for f in manifest["files"].values()]),
                    "--domain-rewards", json.dumps(manifest["domain_rewards"]),
                    "--counterpart-options", json.dumps(endpoint), "--reward-options", json.dumps({"behaviour": judge}),
                    "--prompts-per-step", "8", "--rollouts-per-prompt", "2", "--max-turns", "1",
                    "--max-new-tokens", "8", "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "run"),
                    module="megatron_mimesis.rl.simulator_rl", timeout=600)
        judged = sum(r.get("messages", [{}])[-1].get("content", "").startswith("You are evaluating a simulated user")
                     for r in server.requests)
    records = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in records] == [1, 2], records
    assert {k for r in records for k in r if k.startswith("reward/")} == {f"reward/{d}" for d in manifest["domain_rewards"]}
    assert sum(r["reward_failures"] for r in records) == 0 and judged > 0, records
    # the judge's verdict, weighted as the behaviour reward weighs it: (2 x 0.5 + 1.5 x 0.5 + 1 + 0.5) / 5
    assert all(r["reward/abcd"] == pytest.approx(0.65) for r in records if "reward/abcd" in r), records
    print(f"MEASURED simulator RL on {sum(f['records'] for f in manifest['files'].values())} built records: "
          + "; ".join(f"step {r['iteration']} " + ", ".join(f"{k[7:]} {v:.2f}" for k, v in r.items() if k.startswith("reward/"))
                   for r in records))

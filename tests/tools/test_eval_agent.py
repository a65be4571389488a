import csv
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megatron_mimesis.rl.envs.toy import code_of
from tests.rl.fakes import FakeOpenAIServer

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "eval_agent.py"
_spec = importlib.util.spec_from_file_location("eval_agent", SCRIPT)
eval_agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_agent)

SMALL = ["--env", "toy", "--tasks", "2", "--max-agent-turns", "2", "--max-new-tokens", "8", "--no-progress"]


@contextmanager
def oracle_server(tokenizer):
    """An agent endpoint that always answers the code the user asked for, briefly, after an empty thought."""

    def complete(prompt):
        item = re.findall(r"code for (\w+)", tokenizer.decode(prompt))[-1]
        return f"</think>\n\n{code_of(item)}<|im_end|>"

    with FakeOpenAIServer(complete=complete, encode=lambda text: tokenizer.encode(text, add_special_tokens=False)) \
            as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_dataset):
    return tiny_dataset / "tokenizer"


def test_two_agents_by_two_users(tiny_hf_checkpoint, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    with oracle_server(AutoTokenizer.from_pretrained(tokenizer_dir)) as server:
        code = eval_agent.main([*SMALL, "--agent", f"tiny=hf:{tiny_hf_checkpoint}",
                                "--agent", f"oracle=openai:{server.base_url}@oracle", "--user", "alice=scripted:toy",
                                "--user", "bob=scripted:toy", "--tokenizer", str(tokenizer_dir), "--output", str(out)])
    assert code == 0
    assert {p.name for p in out.iterdir()} == {"results.json", "table.csv", "table.md", "scores.png", "episodes.jsonl",
                                            "cache.jsonl"}
    assert (out / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = json.loads((out / "results.json").read_text())
    pairs = {(p["agent"], p["user"]): p for p in results["pairs"]}
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 8 and {e["status"] for e in episodes} == {"scored"}
    for (agent, user), pair in pairs.items():
        rewards = [e["reward"] for e in episodes if (e["agent"], e["user"]) == (agent, user)]
        assert pair["n_episodes"] == pair["n_scored"] == 2 and pair["failures"] == {}
        assert pair["score"] == pytest.approx(sum(rewards) / 2)
        assert sorted(r for task in pair["task_rewards"].values() for r in task) == sorted(rewards)
    # the oracle's first answer is brief and holds the code (1 + 1), and the user stops right there
    assert pairs["oracle", "alice"]["score"] == pairs["oracle", "bob"]["score"] == 2.0
    assert pairs["tiny", "alice"]["score"] < 2.0

    users = ["alice", "bob"]
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [r["agent"] for r in rows] == ["tiny", "oracle"]
    for row in rows:
        scores = [pairs[row["agent"], u]["score"] for u in users]
        assert [float(row[u]) for u in users] == pytest.approx(scores)
        assert float(row["average"]) == pytest.approx(sum(scores) / 2)
    assert [float(r["mean_rank"]) for r in rows] == [2.0, 1.0]  # the oracle ranks first for every user
    assert [r["ranks"] for r in results["table"]] == [{"alice": 2.0, "bob": 2.0}, {"alice": 1.0, "bob": 1.0}]

    markdown = (out / "table.md").read_text()
    assert markdown.splitlines()[0] == "| Agent | alice | bob | Average | Mean rank |"
    assert "| oracle | 2.000 | 2.000 | 2.000 | 1.00 |" in markdown
    # what each score rests on, and the warning below the floor (--min-tasks, 30 by default): table and stderr
    assert "Measured on (tasks with a scored episode; episodes scored of played):\n- tiny x alice: 2 tasks; 2 of 2 " \
           "episodes\n" in markdown
    warning = ("warning: a score rests on 2 tasks, fewer than --min-tasks 30: differences between agents may be noise; "
               "evaluate more tasks (--tasks, the split)")
    output = capsys.readouterr()
    assert markdown in output.out and markdown.endswith(f"\n{warning}\n") and warning in output.err
    assert all(p["n_tasks_scored"] == 2 for p in results["pairs"])


def test_failed_requests_are_left_out_and_counted(tokenizer_dir, tmp_path):
    out = tmp_path / "eval"
    with oracle_server(AutoTokenizer.from_pretrained(tokenizer_dir)) as server:
        server.failures = [500] * 4  # the first agent request fails through all of the client's retries
        code = eval_agent.main([*SMALL, "--agent", f"oracle=openai:{server.base_url}@oracle", "--user",
                                "alice=scripted:toy", "--tokenizer", str(tokenizer_dir), "--concurrency", "1",
                                "--output", str(out)])
    assert code == 0
    pair = json.loads((out / "results.json").read_text())["pairs"][0]
    assert pair["failures"] == {"agent_error": 1} and (pair["n_episodes"], pair["n_scored"]) == (2, 1)
    assert pair["task_rewards"] == {"toy-4": [None], "toy-5": [2.0]} and pair["score"] == 2.0
    failed = json.loads((out / "episodes.jsonl").read_text().splitlines()[0])
    assert failed["status"].startswith("failed: error: agent: error: completion request to http") and failed["reward"] is None
    assert "oracle x alice: 1 of 2 episodes unscored (agent_error: 1)" in (out / "table.md").read_text()


def test_refuses_a_non_empty_output_without_overwrite(tokenizer_dir, tmp_path, capsys):
    (tmp_path / "old.txt").write_text("keep me")
    args = [*SMALL, "--agent", "a=openai:http://127.0.0.1:9/v1@m", "--user", "u=scripted:toy",
            "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path)]
    assert eval_agent.main(args) == 2
    assert capsys.readouterr().err.strip() == (f"error: --output {tmp_path} is not empty; pass --resume to continue it "
                                               f"or --overwrite")


@pytest.mark.parametrize("flags, message", [
    (["--agent", "tiny"], "expected NAME=SPEC"),
    (["--agent", "a=vllm:x"], "SPEC must be one of hf:..., openai:..."),
    (["--agent", "a=scripted:toy"], "SPEC must be one of hf:..., openai:..."),
    (["--agent", "a=hf:/no/such/dir"], "not an HF checkpoint directory"),
    (["--agent", "a=openai:localhost:8000@m"], "expected openai:BASE_URL@MODEL"),
    (["--agent", "a=openai:http://h/v1@m", "--agent", "a=openai:http://h/v1@n"], "names must be unique; repeated: a"),
    (["--agent", "a=openai:http://h/v1@m", "--user", "u=scripted:tau2"], "scripted:toy is the only scripted user"),
    (["--agent", "a=openai:http://h/v1@m", "--env-options", "[1]"], "--env-options must be a JSON object"),
    (["--agent", "a=openai:http://h/v1@m", "--env-options", '{"colour": 1}'], "do not fit the toy env"),
    (["--agent", "a=openai:http://h/v1@m", "--split", "dev"], "splits 'train' and 'test', not 'dev'"),
    (["--agent", "a=openai:http://h/v1@m", "--tasks", "9"], "--tasks 9: split 'test' of toy has 4 tasks"),
])
def test_bad_input_is_one_line(flags, message, tokenizer_dir, tmp_path, capsys):
    users = [] if "--user" in flags else ["--user", "u=scripted:toy"]
    code = eval_agent.main([*SMALL, *flags, *users, "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "o").exists()


def test_openai_agent_without_a_tokenizer_is_refused(tmp_path, capsys):
    code = eval_agent.main([*SMALL, "--agent", "a=openai:http://h/v1@remote-name", "--user", "u=scripted:toy",
                            "--output", str(tmp_path / "o")])
    assert code == 2 and "an openai agent needs --tokenizer" in capsys.readouterr().err


def test_a_killed_evaluation_resumed_gives_the_table_of_an_uninterrupted_one(tiny_hf_checkpoint, tokenizer_dir,
                                                                              tmp_path):
    """A 1-day agent evaluation (the paper's: 8 gyms x 4 trials x 2 agents) killed in its third chunk continues with
    --resume from the chunks it finished, plays only the rest, and writes what an uninterrupted run writes; the
    sampled agent (temperature 1) shows that each chunk keeps its seeds."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    flags = [*SMALL[:2], "--tasks", "4", "--trials", "2", "--max-agent-turns", "2", "--max-new-tokens", "8",
             "--temperature", "1.0", "--chunk-tasks", "1", "--no-progress", "--agent", f"tiny=hf:{tiny_hf_checkpoint}",
             "--user", "alice=scripted:toy", "--tokenizer", str(tokenizer_dir)]
    with oracle_server(tokenizer) as server:
        oracle = ["--agent", f"oracle=openai:{server.base_url}@oracle"]
        assert eval_agent.main([*flags, *oracle, "--output", str(tmp_path / "whole")]) == 0
        answered = len(server.requests)
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert whole["pairs"][0]["n_episodes"] == whole["pairs"][1]["n_episodes"] == 8 and answered == 8

    release = threading.Event()
    blocking = oracle_server(tokenizer)
    with blocking as server:
        oracle = ["--agent", f"oracle=openai:{server.base_url}@oracle"]
        answer = server.complete
        server.complete = lambda prompt: answer(prompt) if len(server.requests) <= 4 or release.wait() else ""
        out = tmp_path / "killed"
        process = subprocess.Popen([sys.executable, str(SCRIPT), *flags, *oracle, "--output", str(out)],
                                   cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            cache = out / "cache.jsonl"
            deadline = time.monotonic() + 240
            while not (cache.exists() and len(cache.read_text().splitlines()) == 6):  # tiny's 4 chunks, oracle's 2
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
                time.sleep(0.2)
            process.kill()  # a hard kill: a preempted job gets no say
            process.wait()
        finally:
            release.set()
            if process.poll() is None:
                process.kill()
        assert not (out / "results.json").exists()
        server.complete, played = answer, len(server.requests)
        assert eval_agent.main([*flags, *oracle, "--output", str(out), "--resume"]) == 0
        replayed = len(server.requests) - played
    assert replayed == 4  # the oracle's two unfinished chunks, nothing of the finished ones
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["pairs"] == whole["pairs"] and resumed["table"] == whole["table"]
    assert (out / "table.md").read_text() == (tmp_path / "whole" / "table.md").read_text()
    assert (out / "episodes.jsonl").read_text() == (tmp_path / "whole" / "episodes.jsonl").read_text()
    assert {p["agent"]: p["score"] for p in resumed["pairs"]}["tiny"] < 2.0  # the sampled agent: not the oracle's


def test_ranks_share_ties_and_skip_missing_scores():
    assert eval_agent.average_ranks({"a": 1.0, "b": 1.0, "c": 0.5}) == {"a": 1.5, "b": 1.5, "c": 3.0}
    pairs = [{"agent": a, "user": u, "score": s} for a, u, s in
             [("x", "u1", 0.5), ("y", "u1", 0.9), ("z", "u1", 0.5), ("x", "u2", 1.0), ("y", "u2", None),
              ("z", "u2", 0.0)]]
    rows = {r["agent"]: r for r in eval_agent.summarize(pairs, ["x", "y", "z"], ["u1", "u2"])}
    assert rows["x"]["ranks"] == {"u1": 2.5, "u2": 1.0} and rows["x"]["mean_rank"] == 1.75
    assert rows["x"]["average"] == 0.75
    assert rows["y"]["ranks"] == {"u1": 1.0, "u2": None} and rows["y"]["average"] is rows["y"]["mean_rank"] is None


def _judge(verdicts):
    """A TelepathyGym user that judges every guess by the next of ``verdicts`` (cycling)."""
    count = iter(range(10 ** 6))

    def reply(messages):
        verdict = verdicts[next(count) % len(verdicts)]
        return f'{{"thought": "t", "judgment": "{verdict}", "feedback": "You said {verdict.lower()}."}}'
    return reply


def test_two_gyms_by_three_user_models_are_scored_as_the_paper_scores_them(tokenizer_dir, tmp_path):
    """An agent that plays FunctionGym right (it asks for the test case, then answers the data's own value) and always
    guesses in TelepathyGym, against users that accept every guess, refuse every guess, or refuse then accept: each
    gym's column is its tasks' best of 2 trials, the average weighs the tasks of both gyms alike."""
    pytest.importorskip("functiongym", reason="UserRL's gyms: make venv installs them from ../shared/third_party")
    from functiongym.data_loader import load_functions

    from tests.rl.envs.test_userrl import call

    answers = {tuple(f["test_case"]): f["expected_result"] for f in load_functions()}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def complete(prompt):  # after an empty thought, as the prompt opens one
        text = tokenizer.decode(prompt)
        if "hidden function" in text:
            cases = re.findall(r"Test case: \[([^\]]*)\]", text)
            if not cases:
                return f"</think>\n\n{call('search', 'test')}<|im_end|>"
            answer = answers[tuple(int(x) for x in cases[-1].split(","))]
            return f"</think>\n\n{call('answer', f'{answer:g}')}<|im_end|>"
        return f"</think>\n\n{'I am done.' if 'Reward:' in text else call('answer', 'a person')}<|im_end|>"

    out = tmp_path / "eval"
    gyms = json.dumps({"gyms": {"FunctionGym": {}, "TelepathyGym": {}}})
    with (FakeOpenAIServer(complete=complete, encode=lambda t: tokenizer.encode(t, add_special_tokens=False)) as agent,
          FakeOpenAIServer(reply=_judge(["Yes"])) as agreeable, FakeOpenAIServer(reply=_judge(["No"])) as strict,
          FakeOpenAIServer(reply=_judge(["No", "Yes"])) as picky):
        users = [f"{name}=openai:{server.base_url}@judge"
                 for name, server in (("agreeable", agreeable), ("strict", strict), ("picky", picky))]
        code = eval_agent.main(["--env", "userrl", "--env-options", gyms, "--tasks", "1", "--trials", "2",
                                "--max-agent-turns", "3", "--concurrency", "1", "--no-progress",
                                "--agent", f"oracle=openai:{agent.base_url}@oracle", "--tokenizer", str(tokenizer_dir),
                                *(flag for user in users for flag in ("--user", user)), "--output", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["env_options"]["reward"] == "eval"  # the gyms' evaluation reward unless asked otherwise
    pairs = {p["user"]: p for p in results["pairs"]}
    assert {user: p["domain_scores"] for user, p in pairs.items()} == {
        "agreeable": {"FunctionGym": 1.0, "TelepathyGym": 1.0}, "strict": {"FunctionGym": 1.0, "TelepathyGym": 0.0},
        "picky": {"FunctionGym": 1.0, "TelepathyGym": 1.0}}  # picky accepted one of the two trials: best of 2
    assert {user: p["score"] for user, p in pairs.items()} == {"agreeable": 1.0, "strict": 0.5, "picky": 1.0}
    assert sorted(pairs["picky"]["task_rewards"][next(t for t in pairs["picky"]["task_rewards"]
                                                      if t.startswith("Telepathy"))]) == [0.0, 1.0]
    domains = (out / "domains.md").read_text()
    assert domains.splitlines()[0] == "| Agent | User | FunctionGym | TelepathyGym | Average |"
    assert "| oracle | strict | 1.000 | 0.000 | 0.500 |" in domains
    assert [r["average"] for r in csv.DictReader((out / "domains.csv").open())] == ["1", "0.5", "1"]
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    function = next(e for e in episodes if e["task_id"].startswith("FunctionGym") and e["user"] == "strict")
    assert [m["role"] for m in function["messages"]] == ["user", "assistant", "tool", "assistant", "tool"]
    assert function["messages"][-1]["content"] == "Your answer is correct!\nReward: 1"
    assert function["termination"] == "env_done" and function["score_info"]["success"]


def test_userrl_refuses_user_sampling_options_its_gyms_would_ignore(tokenizer_dir, tmp_path, capsys):
    pytest.importorskip("functiongym", reason="UserRL's gyms: make venv installs them from ../shared/third_party")
    args = ["--env", "userrl", "--env-options", json.dumps({"gyms": {"FunctionGym": {}}}), "--tokenizer",
            str(tokenizer_dir), "--agent", "a=openai:http://h/v1@m", "--user", "u=openai:http://h/v1@u", "--output",
            str(tmp_path / "o")]
    for flags in (["--user-temperature", "0.7"], ["--user-max-new-tokens", "64", "--user-temperature", "0"]):
        assert eval_agent.main([*args, *flags]) == 2
        given = ", ".join(f for f in flags if f.startswith("--"))
        assert capsys.readouterr().err == (f"error: {given}: userrl's envs sample their user themselves; set a gym's "
                                           f"request_fields in --env-options instead\n")
    with pytest.raises(SystemExit):
        eval_agent.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a task scores the mean of its trials on tau2 and toy, their best on userrl" in help_text

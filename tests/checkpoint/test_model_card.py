"""An export's model card: the stages that made it, read back through each checkpoint's ``load`` to its starting
weights, with the data manifests' counts; how to talk to it; and the last evaluation run on the export itself."""

import json

import yaml

from megatron_mimesis.checkpoint.conversion import export_to_hf, import_from_hf
from megatron_mimesis.checkpoint.model_card import CARD, EVAL_BEGIN, NO_EVALUATION, card_text, record_evaluation
from megatron_mimesis.models.presets import get_preset, preset_record
from tests.checkpoints import small_checkpoint
from tests.eval.conftest import write_conversations
from tests.eval.test_cli import eval_simulator

PRESET = get_preset("tiny")
MIDTRAIN = {"stage": "midtrain", "lr": 3e-5, "lr_decay_style": "cosine", "global_batch_size": 4096,
            "seq_length": 24576, "train_iters": 2400}
RL = {"stage": "rl_simulator", "lr": 1e-6, "lr_decay_style": "constant", "global_batch_size": 512, "seq_length": 8192,
      "train_iters": 100, "prompts": ["data/rl/soul.jsonl"], "prompts_per_step": 64, "rollouts_per_prompt": 8,
      "temperature": 1.0, "top_p": 1.0, "thinking": True}

AGENT = {"stage": "rl_agent", "lr": 1e-6, "lr_decay_style": "constant", "global_batch_size": 512, "seq_length": 32768,
         "train_iters": 180, "env": "userrl", "env_options": {"gyms": {"TauGym": {}, "FunctionGym": {}}},
         "tasks_per_step": 64, "rollouts_per_prompt": 8, "temperature": 1.0, "top_p": 1.0, "thinking": False}


def _stage(root, iteration, run_config):
    directory = small_checkpoint(root, iteration)
    (directory / "run_config.json").write_text(json.dumps(run_config))
    return directory


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_the_card_follows_every_stage_back_to_its_starting_weights(tiny_dataset, tmp_path):
    record = {"preset": preset_record(PRESET), "padded_vocab_size": 512}
    imported = _stage(tmp_path / "import", 0, {**record, "source": "/models/Qwen3.5-9B"})
    midtrain = _stage(tmp_path / "midtrain", 2400, {**record, "train": {**MIDTRAIN, "load": str(imported.parent),
                                                                          "data_path": str(tiny_dataset)}})
    rl_config = {**record, "train": {**RL, "load": str(midtrain.parent)}}
    rl = _stage(tmp_path / "rl", 60, rl_config)

    text = card_text("mimesis-sim", rl, rl_config, PRESET, "bf16")
    assert _front_matter(text) == {"library_name": "transformers", "pipeline_tag": "text-generation",
                                   "tags": ["megatron-mimesis", "user-simulator", "qwen3_5"]}
    assert "Starting weights: imported from the HF checkpoint `/models/Qwen3.5-9B`." in text
    rows = [line for line in text.splitlines() if line.startswith("| midtrain") or line.startswith("| rl_simulator")]
    assert [row.split(" | ")[0] for row in rows] == ["| midtrain", "| rl_simulator"]  # oldest first
    manifest = json.loads((tiny_dataset / "manifest.json").read_text())["corpora"]["chitchat"]
    assert rows[0].startswith("| midtrain | 2,400 of 2,400 | lr 3e-05 cosine; global batch 4096 x 24576 tokens | ")
    assert manifest["skipped"] == {}  # the first 300 conversations of the corpus hold none of its bad records
    assert (f"(chitchat: {manifest['conversations']:,} conversations, {manifest['tokens']['train']:,} training "
            "tokens)") in rows[0]
    assert rows[1].startswith("| rl_simulator | 60 of 100 | lr 1e-06 constant; 64 prompts x 8 rollouts per step, "
                              "temperature 1, top-p 1; thinking on | prompts `data/rl/soul.jsonl` | ")
    assert "Thinking is on by default (serve with `--reasoning-parser qwen3`" in text
    assert "It ends the conversation by writing `<END>`" in text and "mimesis-serve EXPORT --name mimesis-sim --end-marker '###STOP###'" in text
    assert "temperature 1, top-p 1, no top-k" in text
    assert f"{EVAL_BEGIN}\n{NO_EVALUATION}" in text

    agent_config = {**record, "train": {**AGENT, "load": str(midtrain.parent)}}
    agent = card_text("agent", _stage(tmp_path / "agent", 30, agent_config), agent_config, PRESET, "bf16")
    assert "- agent" in agent and "user simulator" not in agent and "--tool-call-parser qwen3_coder" in agent
    assert EVAL_BEGIN not in agent
    assert ("| rl_agent | 30 of 180 | lr 1e-06 constant; 64 tasks x 8 rollouts per step, temperature 1, top-p 1 | "
            "env `userrl` (TauGym, FunctionGym) | ") in agent


def test_an_export_carries_its_card_and_an_evaluation_replaces_the_last_one(tiny_hf_checkpoint, tiny_dataset,
                                                                            tmp_path):
    import_from_hf(tiny_hf_checkpoint, tmp_path / "mcore", progress=False)
    export = export_to_hf(tmp_path / "mcore", tmp_path / "sim", tokenizer=str(tiny_dataset / "tokenizer"),
                          progress=False)
    text = (export / CARD).read_text()
    assert f"Starting weights: imported from the HF checkpoint `{tiny_hf_checkpoint}`." in text
    assert "exported as `Qwen3_5ForCausalLM` in bf16" in text

    table = tmp_path / "eval" / "table.md"  # an evaluation of the export puts its table into the card
    assert eval_simulator.main(["--simulator", f"sim=hf:{export}", "--input", str(write_conversations(tmp_path / "h.jsonl")),
                                "--max-new-tokens", "2", "--bootstrap", "0", "--output", str(table.parent),
                                "--no-progress"]) == 0
    evaluated = (export / CARD).read_text()
    assert table.read_text().strip() in evaluated and "this export is the row `sim`; 3 held-out conversations of " \
        "`h.jsonl`" in evaluated and NO_EVALUATION not in evaluated

    assert record_evaluation(export, "| | NLL |\n|---|---:|\n| sim | 6.5 |\n", "first run")
    assert record_evaluation(export, "| | NLL |\n|---|---:|\n| sim | 6.1 |\n", "second run")
    after = (export / CARD).read_text()
    assert "second run" in after and "6.1" in after and "first run" not in after and NO_EVALUATION not in after
    assert after.split(EVAL_BEGIN)[0] == text.split(EVAL_BEGIN)[0] and after.endswith(text.split("-->")[-1])
    assert not record_evaluation(tmp_path, "| x |", "no card here")

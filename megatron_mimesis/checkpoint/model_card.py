"""The model card an export carries (``README.md`` with the HF hub's metadata header), written from the run's records.

An export travels without this repository: to a colleague, to the hub, into someone's agent framework. What a user of
it must know is then only in the card: what it is (family, size), how it was made (every stage back to its starting
weights, read from each checkpoint's ``run_config.json`` through its ``load``, with the data manifests' counts), how
to talk to it (a simulator's reversed roles, its end marker and the relay that rewrites it, its sampling), and how
it measured where it was evaluated. Nothing in it is typed by hand: a fact the records do not hold is left out.

``tools/eval_simulator.py`` writes its table into the card of an ``hf:`` simulator export it evaluates (the section
between :data:`EVAL_BEGIN` and :data:`EVAL_END`), so the card shows the last evaluation run on the export itself. An
agent's card has no such section: ``tools/eval_agent.py`` plays agents through servers, not export directories.
"""

import json
import os
from pathlib import Path

from data_prep.render import END_MARKER
from megatron_mimesis.checkpoint.integrity import RUN_CONFIG, CheckpointError
from megatron_mimesis.checkpoint.serving import plays_the_user, recipe_sampling, trained_with_thinking
from megatron_mimesis.models.family import Preset, parameter_count

CARD = "README.md"
EVAL_BEGIN, EVAL_END = "<!-- evaluation -->", "<!-- end evaluation -->"
NO_EVALUATION = "No evaluation has been run on this export yet (`tools/eval_simulator.py --simulator NAME=hf:DIR` " \
                "writes its table here)."
MAX_STAGES = 32  # a lineage longer than this is a loop of load paths


def lineage(checkpoint: Path, run_config: dict) -> tuple[list[dict], str]:
    """The training stages that made ``checkpoint``, oldest first (each: its checkpoint directory, iteration and
    ``train`` settings), and where the first one started (random weights, an HF import, pretrained_hf)."""
    from megatron_mimesis.checkpoint.reader import checkpoint_iteration, resolve_checkpoint_dir

    stages, directory, config = [], checkpoint, run_config
    while len(stages) < MAX_STAGES:
        train = config.get("train")
        if not train:
            source = config.get("source")
            return stages[::-1], f"imported from the HF checkpoint `{source}`" if source else "an HF import"
        stages.append({"dir": str(directory), "iteration": checkpoint_iteration(directory), "train": train})
        if train.get("pretrained_hf"):
            return stages[::-1], f"the HF checkpoint `{train['pretrained_hf']}`"
        if not train.get("load"):
            return stages[::-1], "random initialisation"
        try:
            directory = resolve_checkpoint_dir(train["load"])
            config = json.loads((directory / RUN_CONFIG).read_text())
        except (CheckpointError, OSError, json.JSONDecodeError) as err:
            return stages[::-1], f"`{train['load']}`, no longer readable ({err})"
    return stages[::-1], f"(lineage cut at {MAX_STAGES} stages)"


def _data(train: dict) -> str:
    if train.get("data_path"):
        manifest_path = Path(train["data_path"]) / "manifest.json"
        if not manifest_path.is_file():
            return f"`{train['data_path']}`"
        corpora = json.loads(manifest_path.read_text()).get("corpora", {})
        parts = []
        for name, c in corpora.items():
            skipped = sum(c.get("skipped", {}).values())
            parts.append(f"{name}: {c['conversations']:,} conversations, {c['tokens']['train']:,} training tokens"
                         + (f" ({skipped:,} bad records skipped)" if skipped else ""))
        return f"`{train['data_path']}` ({'; '.join(parts)})"
    if train.get("prompts"):
        return "prompts " + ", ".join(f"`{p}`" for p in train["prompts"])
    if train.get("env"):
        gyms = (train.get("env_options") or {}).get("gyms")
        return f"env `{train['env']}`" + (f" ({', '.join(gyms)})" if gyms else "")
    return ""


def _settings(train: dict) -> str:
    parts = [f"lr {train['lr']:g} {train.get('lr_decay_style', '')}".strip()]
    if train.get("rollouts_per_prompt"):  # RL: simulator RL draws prompts, agent RL tasks
        unit = "tasks" if "tasks_per_step" in train else "prompts"
        parts.append(f"{train.get(unit + '_per_step')} {unit} x {train['rollouts_per_prompt']} rollouts per step, "
                     f"temperature {train['temperature']:g}, top-p {train['top_p']:g}")
    else:
        parts.append(f"global batch {train['global_batch_size']} x {train['seq_length']} tokens")
    if train.get("thinking") or train.get("stage") == "sft":
        parts.append("thinking on")
    return "; ".join(parts)


def _size(preset: Preset) -> str:
    return (f"{parameter_count(preset) / 1e6:,.1f}M parameters: {preset.num_layers} layers, hidden "
            f"{preset.hidden_size}, vocabulary {preset.vocab_size:,}")


def _usage(run_config: dict, served_name: str, reasoning_parser: str) -> list[str]:
    sampling = recipe_sampling(run_config)
    thinking = trained_with_thinking(run_config)
    return [
        "## Using it as a user simulator", "",
        "It plays the **user** of a conversation. Talk to it as user-simulator frameworks do (tau2-bench's "
        "`UserSimulator` sends exactly this): `system` is the simulator's instructions or persona, `user` the "
        "agent's turns, `assistant` the simulator's own earlier turns; the reply is the user's next turn. The "
        "bundled `chat_template.jinja` renders that into the rendering the model was trained on (roles reversed), "
        "so serve it with no `--chat-template`. Pass `chat_template_kwargs: {\"simulator_role\": \"user\"}` for a "
        "conversation already in the training roles.", "",
        f"Thinking is {'on' if thinking else 'off'} by default"
        + (f" (serve with `--reasoning-parser {reasoning_parser}` to get the thoughts as `reasoning_content`)"
           if thinking else "")
        + "; a request may set `chat_template_kwargs: {\"enable_thinking\": ...}`.", "",
        f"It ends the conversation by writing `{END_MARKER}`. The marker relay rewrites that in every completion, "
        "streamed or not, to the marker your client listens for (tau2: `###STOP###`). `mimesis-serve` (from "
        "megatron-mimesis) starts vLLM with the relay in front:", "",
        "```bash",
        f"mimesis-serve EXPORT --name {served_name} --end-marker '###STOP###'   # vLLM and the relay, on port 8000",
        "```", "",
        f"Sampling as trained (`generation_config.json`): temperature {sampling['temperature']:g}, top-p "
        f"{sampling['top_p']:g}, no top-k; stops at `<|im_end|>`. Truncated assistant-style sampling makes a less "
        "varied user than the one trained.", "",
    ]


def card_text(name: str, checkpoint: Path, run_config: dict, preset: Preset, dtype: str) -> str:
    """The card of an export called ``name`` of ``checkpoint``."""
    simulator = plays_the_user(run_config)
    family = preset.family
    stages, start = lineage(checkpoint, run_config)
    header = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- megatron-mimesis",
              f"- {'user-simulator' if simulator else 'agent'}", f"- {family.name}", "---", ""]
    role = "a user simulator" if simulator else "an agent"
    lines = [f"# {name}: {role} trained with megatron-mimesis", "",
             f"{family.title} (`{preset.name}` preset; {_size(preset)}), exported as `{family.hf_architecture}` in "
             f"{dtype} from `{checkpoint}`.", "", "## How it was trained", "", f"Starting weights: {start}.", ""]
    if stages:
        lines += ["| stage | steps | settings | data | checkpoint |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s['train']['stage']} | {s['iteration']:,} of {s['train']['train_iters']:,} | "
                  f"{_settings(s['train'])} | {_data(s['train'])} | `{s['dir']}` |" for s in stages]
        lines.append("")
    if simulator:
        lines += _usage(run_config, name, family.chat.reasoning_parser)
    else:
        parser = family.chat.tool_call_parser
        lines += ["## Using it as an agent", "",
                  f"It is served with the tokenizer's own chat template; its tool calls are in the `{parser}` format "
                  f"(`vllm serve EXPORT --enable-auto-tool-choice --tool-call-parser {parser}`).", ""]
        return "\n".join(header + lines)
    lines += ["## Evaluation", "", EVAL_BEGIN, NO_EVALUATION, EVAL_END, ""]
    return "\n".join(header + lines)


def write_card(directory: Path, name: str, checkpoint: Path, run_config: dict, preset: Preset, dtype: str) -> None:
    """The card of export ``name`` into ``directory`` (the export's, or the temporary one it is written in)."""
    (directory / CARD).write_text(card_text(name, checkpoint, run_config, preset, dtype))


def record_evaluation(export: Path, table_markdown: str, what: str) -> bool:
    """Put an evaluation's table into the card of ``export`` (replacing the last one); False when the export has
    no card written by :func:`write_card`. The file is replaced atomically."""
    path = export / CARD
    if not path.is_file():
        return False
    text = path.read_text()
    if EVAL_BEGIN not in text or EVAL_END not in text:
        return False
    before, rest = text.split(EVAL_BEGIN, 1)
    after = rest.split(EVAL_END, 1)[1]
    body = f"{what}\n\n{table_markdown.strip()}\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{before}{EVAL_BEGIN}\n{body}{EVAL_END}{after}")
    os.replace(tmp, path)
    return True

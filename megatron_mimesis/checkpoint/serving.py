"""What makes an exported checkpoint a servable user simulator: its chat template and its generation defaults.

A user simulator is driven by other people's tools (vLLM's OpenAI server, tau2-bench's ``UserSimulator``, any
user-simulator framework), and those send a chat request in their own convention: the simulator's instructions
as ``system``, the agent's turns as ``user``, the simulator's own turns as ``assistant``. The model was trained
on the opposite rendering (``data_prep.render``: the simulator speaks as ``user``), so the export carries a chat
template (``simulator_chat_template.jinja``, the one source) that renders such a request into exactly the
training rendering, with the generation prompt opening the user's turn. How the checkpoint was trained decides
its default: thinking on after thought-supervised SFT (``stage: sft``) or an RL run with ``thinking: true``.
An agent-RL checkpoint plays the assistant, so its export keeps the tokenizer's own template.

``generation_config.json`` carries the stop ids (``<|im_end|>``, ``<|endoftext|>``) and the recipe's sampling:
the run's own ``temperature`` / ``top_p`` when it was an RL run, else untruncated sampling, the distribution
mid-training and SFT fit. A released Qwen3.5's generation config recommends Qwen's assistant sampling (top-k and
top-p truncation), which is not the distribution the simulator was trained or RL'd under, so it is not copied.
"""

import json
from pathlib import Path

from data_prep.tokenizer import ENDOFTEXT, IM_END, TextEncoder

TEMPLATE_SOURCE = Path(__file__).with_name("simulator_chat_template.jinja")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
AGENT_STAGE = "rl_agent"
UNTRUNCATED_SAMPLING = {"temperature": 1.0, "top_p": 1.0}


def simulator_chat_template(thinking: bool) -> str:
    """The template source with its default thinking mode set (a request may still pass ``enable_thinking``)."""
    return f"{{%- set default_thinking = {'true' if thinking else 'false'} %}}\n" + TEMPLATE_SOURCE.read_text()


def _train(run_config: dict) -> dict:
    return run_config.get("train") or {}


def plays_the_user(run_config: dict) -> bool:
    """Every stage but agent RL trains the user side (an HF import, with no training stage, is a starting point
    for one)."""
    return _train(run_config).get("stage") != AGENT_STAGE


def trained_with_thinking(run_config: dict) -> bool:
    train = _train(run_config)
    return bool(train.get("thinking", train.get("stage") == "sft"))


def recipe_sampling(run_config: dict) -> dict:
    train = _train(run_config)
    return {"do_sample": True, **{key: float(train.get(key, default)) for key, default in UNTRUNCATED_SAMPLING.items()}}


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """The chat special tokens' ids; a tokenizer without them cannot render the template (the error names the
    directory and what is wrong)."""
    try:
        return TextEncoder(tokenizer_dir).special
    except (FileNotFoundError, ValueError):
        raise
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{tokenizer_dir / 'tokenizer.json'}: not a tokenizer ({err})") from None


def install_chat_template(tokenizer_dir: Path, template: str) -> None:
    """``chat_template.jinja`` (what transformers >= 4.47 and vLLM read) and the same text in
    ``tokenizer_config.json`` (what older readers take), replacing whatever template the tokenizer came with."""
    (tokenizer_dir / TEMPLATE_FILE).write_text(template)
    config_path = tokenizer_dir / TOKENIZER_CONFIG
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def generation_config(run_config: dict, special: dict[str, int]):
    from transformers import GenerationConfig

    return GenerationConfig(**recipe_sampling(run_config), bos_token_id=special[ENDOFTEXT],
                            pad_token_id=special[ENDOFTEXT], eos_token_id=[special[IM_END], special[ENDOFTEXT]])


def make_servable(out: Path, run_config: dict, special: dict[str, int]) -> None:
    """Write the generation config and, for a user-side checkpoint, the simulator's chat template into ``out``
    (an export whose tokenizer files are already there)."""
    generation_config(run_config, special).save_pretrained(out)
    if plays_the_user(run_config):
        install_chat_template(out, simulator_chat_template(trained_with_thinking(run_config)))

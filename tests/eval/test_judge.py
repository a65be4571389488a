"""Judged metrics through a scripted OpenAI-compatible judge: Turing distance, behaviour Dice, the cache."""

import json
import re

import pytest

from megatron_mimesis.eval.cache import ResultCache
from megatron_mimesis.eval.evaluation import HUMAN, add_judgements, label_humans, metric_table
from megatron_mimesis.eval.heldout import input_corpora, read_conversations
from megatron_mimesis.eval.judge import (
    DEFAULT_TAXONOMY,
    Judge,
    TaxonomyError,
    human_first,
    load_taxonomy,
    parse_labels,
)
from tests.eval.conftest import AssistantSimulator, EchoSimulator
from tests.eval.test_metrics import table_of
from tests.rl.fakes import FakeOpenAIServer

TAXONOMY = {"asks_question": "asks something", "humour": "jokes"}


def candidates(prompt: str) -> tuple[str, str]:
    a = re.search(r"Candidate A:\n(.*?)\n\nCandidate B:", prompt, re.S).group(1)
    b = re.search(r"Candidate B:\n(.*?)\n\nWhich candidate", prompt, re.S).group(1)
    return a, b


def judge_reply(turing, labels=lambda message: ["asks_question"] if "?" in message else []):
    def reply(messages):
        prompt = messages[-1]["content"]
        if "Candidate A:" in prompt:
            return turing(*candidates(prompt))
        message = re.search(r"Message to label:\n(.*?)\n\nAnswer with", prompt, re.S).group(1)
        return json.dumps(labels(message))

    return reply


def judged_cells(server, tmp_path, taxonomy=None, simulators=None):
    simulators = simulators or (EchoSimulator(), AssistantSimulator())
    held_out = read_conversations(input_corpora([str(tmp_path / "heldout.jsonl")]))
    rows, _ = table_of(list(simulators), held_out, tmp_path, n_boot=0)
    by_key = {p.key: p for p in held_out.positions}
    cache = ResultCache(tmp_path / "judge.jsonl")
    judge = Judge(server.base_url, "judge", cache, taxonomy, seed=0, concurrency=2)
    if taxonomy:
        label_humans(rows[0], judge, by_key, progress=False)
    for row in rows[1:]:
        add_judgements(row, rows[0], judge, by_key, progress=False)
    cache.close()
    return rows, metric_table(rows, taxonomy, judged=True, n_boot=0, seed=0)["cells"]


def test_a_judge_that_cannot_tell_gives_turing_distance_zero(heldout_file, tmp_path):
    with FakeOpenAIServer(reply=judge_reply(lambda a, b: "4")) as server:
        _, cells = judged_cells(server, tmp_path)
    assert cells["echo"]["turing_distance"]["value"] == 0.0
    assert cells["assistant"]["turing_distance"]["value"] == 0.0
    assert cells[HUMAN]["turing_distance"]["value"] is None


def test_a_judge_that_spots_the_assistant_style_gives_fifty(heldout_file, tmp_path):
    spot = judge_reply(lambda a, b: "7" if a.startswith("Certainly") else "1" if b.startswith("Certainly") else "4")
    with FakeOpenAIServer(reply=spot) as server:
        rows, cells = judged_cells(server, tmp_path)
    assert cells["assistant"]["turing_distance"]["value"] == 50.0
    assert cells["echo"]["turing_distance"]["value"] == 0.0  # both candidates are the human's text: "4"
    ratings = [o["turing_rating"] for o in rows[2].observations]
    assert ratings == [1 if human_first(0, o["key"], "assistant") else 7 for o in rows[2].observations]


def test_the_order_is_a_fair_coin_per_position_and_simulator():
    shown_first = [human_first(0, f"c{i}/0/1", "sim") for i in range(2000)]
    assert 900 < sum(shown_first) < 1100
    assert shown_first == [human_first(0, f"c{i}/0/1", "sim") for i in range(2000)]  # a resumed run asks the same
    assert shown_first != [human_first(1, f"c{i}/0/1", "sim") for i in range(2000)]


def test_behaviour_dice_and_a_resumed_judge_asks_nothing_twice(heldout_file, tmp_path):
    with FakeOpenAIServer(reply=judge_reply(lambda a, b: "4")) as server:
        _, cells = judged_cells(server, tmp_path, TAXONOMY)
        asked = len(server.requests)
        _, again = judged_cells(server, tmp_path, TAXONOMY)
        assert len(server.requests) == asked  # every verdict came from the cache
    assert again == cells
    # humans ask at 2 of 7 positions; the assistant-styled simulator asks at all 7: Dice = 2 * 2 / (2 + 7)
    assert cells["echo"]["dice_asks_question"]["value"] == 1.0
    assert cells["assistant"]["dice_asks_question"]["value"] == pytest.approx(4 / 9)
    assert cells["echo"]["dice_humour"]["value"] is None  # nobody jokes: undefined, not 0 or 1
    # distinct questions: human labels 7 (echo's labels are the same questions), echo's Turing pairs 7, the
    # assistant's Turing pairs 7 and labels 6 (at both openers it says the same with the same empty context)
    assert asked == 7 + 7 + 7 + 6


def test_unusable_verdicts_are_counted_not_scored(heldout_file, tmp_path):
    with FakeOpenAIServer(reply=judge_reply(lambda a, b: "no idea", labels=lambda m: ["gossip"])) as server:
        rows, cells = judged_cells(server, tmp_path, TAXONOMY, simulators=(EchoSimulator(),))
    assert rows[1].judge_errors == {"turing: no rating 1-7 in the answer 'no idea'": 7,
                                    "labels: unknown behaviours ['gossip']": 7}
    assert cells["echo"]["turing_distance"]["value"] is None and cells["echo"]["dice_asks_question"]["value"] is None


def test_failed_judge_requests_are_counted_and_not_cached(heldout_file, tmp_path):
    with FakeOpenAIServer(reply=judge_reply(lambda a, b: "4")) as server:
        server.broken = True
        rows, cells = judged_cells(server, tmp_path, simulators=(EchoSimulator(),))
    assert rows[1].judge_errors == {"turing: InternalServerError": 7}
    assert ResultCache(tmp_path / "judge.jsonl").reused == 0


def test_parse_labels_and_the_taxonomy_file(tmp_path):
    assert parse_labels('Labels: ["humour", "asks_question"]', TAXONOMY) == ["asks_question", "humour"]
    assert parse_labels("none", TAXONOMY) == "no JSON list in the answer"
    taxonomy = load_taxonomy(DEFAULT_TAXONOMY)
    assert len(taxonomy) == 13 and {"hidden_evaluation_criteria", "infeasibility_persistence"} <= set(taxonomy)
    bad = tmp_path / "t.yaml"
    bad.write_text("- name: a\n  description: x\n- name: a\n  description: y\n")
    with pytest.raises(TaxonomyError, match="entry 1 repeats the name 'a'"):
        load_taxonomy(bad)

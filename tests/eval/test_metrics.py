"""The LLM-free behaviour statistics, Dice, ECE and the bootstrap, against scripted simulators and hand counts."""

import math
import random

import pytest

from megatron_mimesis.eval import metrics as M
from megatron_mimesis.eval.behaviour import features
from megatron_mimesis.eval.cache import ResultCache
from megatron_mimesis.eval.calibration import calibration_row, expected_calibration_error
from megatron_mimesis.eval.evaluation import (
    HUMAN,
    RowResult,
    human_observations,
    metric_table,
    replies,
    simulator_observations,
)
from megatron_mimesis.eval.heldout import input_corpora, read_conversations
from tests.eval.conftest import AssistantSimulator, EchoSimulator, FlakySimulator

BEHAVIOUR = [m.name for m in M.BEHAVIOUR]


def table_of(simulators, held_out, tmp_path, n_boot=200):
    positions = held_out.positions
    cache = ResultCache(tmp_path / "cache.jsonl")
    rows = [RowResult(HUMAN, human_observations(positions))]
    for simulator in simulators:
        row = RowResult(simulator.name)
        simulator_observations(row, positions, replies(simulator, {"name": simulator.name}, positions, cache, 0, 16,
                                                       progress=False))
        rows.append(row)
    return rows, metric_table(rows, None, judged=False, n_boot=n_boot, seed=0)["cells"]


def test_positions_are_the_user_turns_with_their_context(heldout_file):
    held_out = read_conversations(input_corpora([str(heldout_file)]))
    assert [p.key for p in held_out.positions] == ["c0/0/0", "c0/0/2", "c0/0/4", "c1/0/0", "c1/0/2", "c2/0/1",
                                                  "c2/0/3"]
    last = held_out.positions[2]
    assert last.human == "ok gotta run, talk later" and last.human_ended and last.last_assistant == "me neither, wild"
    assert [m["role"] for m in last.context] == ["user", "assistant", "user", "assistant"]
    assert held_out.positions[0].context == () and not held_out.positions[0].human_ended
    both = read_conversations(input_corpora([str(heldout_file)], user_speaker="both"))
    assert len(both.renderings) == 6 and len(both.positions) == 7 + 6


def test_echo_simulator_is_at_distance_zero_with_the_humans_statistics(heldout_file, tmp_path):
    held_out = read_conversations(input_corpora([str(heldout_file)]))
    _, cells = table_of([EchoSimulator()], held_out, tmp_path)
    assert cells["echo"]["length_distance"]["value"] == 0.0
    for name in BEHAVIOUR:
        assert cells["echo"][name]["value"] == pytest.approx(cells[HUMAN][name]["value"]), name
    # the humans' statistics, counted by hand from conftest.CONVERSATIONS
    human = {name: cells[HUMAN][name]["value"] for name in BEHAVIOUR}
    assert human["question_rate"] == pytest.approx(2 / 7)  # "...last night?" and "right??" ("...tonight" has no "?")
    assert human["end_rate"] == pytest.approx(3 / 7)  # each conversation's last user turn
    assert human["mean_turns"] == pytest.approx(7 / 3) and human["turns_distance"] == 0.0  # 3, 2 and 2 turns
    assert human["assistant_rate"] == 0.0
    words = [8, 7, 5, 5, 5, 8, 5]  # ":)" is no word
    assert human["mean_words"] == pytest.approx(sum(words) / 7)


def test_assistant_styled_simulator_is_far_on_every_llm_free_metric(heldout_file, tmp_path):
    held_out = read_conversations(input_corpora([str(heldout_file)]))
    _, cells = table_of([AssistantSimulator()], held_out, tmp_path)
    human, sim = cells[HUMAN], cells["assistant"]
    far = {"length_distance": 20.0, "mean_words": 20.0, "question_rate": 0.4, "end_rate": 0.4, "distinct_1": 0.3,
           "distinct_2": 0.3, "copy_rate": 0.05, "assistant_rate": 0.9}  # copying: the humans never copy here
    # it never ends: its conversations last as long as the humans' data (censored there), not longer
    same = {"mean_turns", "turns_distance"}
    assert set(far) | same == set(BEHAVIOUR)
    for name, gap in far.items():
        assert abs(sim[name]["value"] - human[name]["value"]) > gap, (name, sim[name], human[name])
    assert sim["turns_distance"]["value"] == 0.0 and sim["mean_turns"]["value"] == human["mean_turns"]["value"]


def test_conversation_lengths_by_hand():
    """Each conversation lasts to the first position where the row ended; the humans' to their last turn."""
    rows = [("a", [False, True, False]), ("b", [False, False]), ("c", [True, False, False, True])]
    obs = [{"unit": unit, "ended": e} for unit, ends in rows for e in ends]
    pairs = [M.conversation_turns(g) for g in M.conversations(obs)]
    assert pairs == [(2, 3), (2, 2), (1, 4)]
    (mean_turns, turns_distance) = (M.BEHAVIOUR[m] for m in M.BEHAVIOUR if m.name in ("mean_turns", "turns_distance"))
    assert mean_turns(obs) == pytest.approx(5 / 3)
    assert turns_distance(obs) == pytest.approx((1 + 1 + 2) / 3)  # sorted 1,2,2 against 2,3,4


def test_failed_generations_are_counted_and_left_out(heldout_file, tmp_path):
    held_out = read_conversations(input_corpora([str(heldout_file)]))
    rows, cells = table_of([FlakySimulator()], held_out, tmp_path)
    flaky = rows[1]
    assert flaky.generation_errors == {"APIConnectionError": 3} and len(flaky.observations) == 4
    assert cells["flaky"]["length_distance"]["value"] == 0.0  # the echoed ones match the humans at their positions
    cache = ResultCache(tmp_path / "cache.jsonl")
    assert cache.reused == 4  # only the successes are kept; a resumed run asks the failed ones again


def test_features_by_hand():
    f = features("Sure thing, I'd be happy to help! - first\n- second?", "happy to help you")
    assert f["words"] == 9 and f["question"] and f["assistant_like"]
    assert f["copy"] == pytest.approx(2 / 8)  # "happy to", "to help" of 8 bigrams
    assert features("lol no", "")["copy"] is None and not features("lol no", "")["assistant_like"]


def test_length_distance_is_the_earth_movers_distance():
    obs = [{"unit": "a", "words": w, "human_words": h} for w, h in [(1, 2), (5, 2), (9, 8)]]
    # sorted 1,5,9 against 2,2,8: (1 + 3 + 1) / 3
    assert M.length_distance(obs) == pytest.approx(5 / 3)


def test_dice_and_turing_distance_by_hand():
    obs = [{"labels": ["humour"], "human_labels": ["humour"]}, {"labels": ["humour"], "human_labels": []},
           {"labels": [], "human_labels": ["humour", "closing"]}, {"labels": None, "human_labels": ["humour"]}]
    assert M.dice("humour")(obs) == pytest.approx(2 * 1 / (2 + 2))  # the unlabelled position is left out
    assert M.dice("closing")(obs) == 0.0 and M.dice("terse_reply")(obs) is None
    assert M.turing_distance([{"turing": c} for c in (1.0, 1.0, 0.5, 0.0)]) == pytest.approx(12.5)


def test_ece_and_gap_by_hand():
    # forecasts 0.05, 0.15 (bins 0, 1) and 0.95, 1.0 (bin 9); outcomes 0, 1, 1, 0
    ece = expected_calibration_error([0.05, 0.15, 0.95, 1.0], [0.0, 1.0, 1.0, 0.0])
    assert ece == pytest.approx(0.25 * 0.05 + 0.25 * 0.85 + 0.5 * abs(0.975 - 0.5))
    pair = {"task_rewards": {"t1": [2.0, 0.0], "t2": [2.0, None], "t3": [None]}}
    row = calibration_row(pair, {"t1": 1.0, "t2": 0.0, "t3": 1.0}, success_reward=2.0)
    assert row["per_task"] == {"t1": 0.5, "t2": 1.0} and row["unscored_tasks"] == 1
    assert row["success_rate"] == 0.75 and row["real_success_rate"] == 0.5 and row["gap"] == pytest.approx(25.0)
    assert row["ece"] == pytest.approx(0.5 * 0.5 + 0.5 * 1.0)


def test_bootstrap_resamples_conversations():
    obs = [{"unit": u, "x": x} for u, x in [("a", 0.0), ("a", 0.0), ("b", 1.0), ("b", 1.0)]]
    mean = M.pooled(M._rate("x"))
    value, low, high = M.bootstrap(obs, mean, 500, seed=1)
    assert value == 0.5 and (low, high) == (0.0, 1.0)  # whole conversations: only 0, 0.5 and 1 can occur
    assert M.bootstrap(obs, mean, 500, seed=1) == (value, low, high)
    assert M.bootstrap(obs, mean, 0, seed=1) == (0.5, None, None)
    assert math.isclose(M.bootstrap([{"unit": "a", "x": 1.0}], mean, 50, 0)[1], 1.0)


def test_a_conversation_drawn_twice_counts_as_two_and_the_interval_contains_the_estimate():
    """Short conversations repeat no word within themselves (distinct-1 = 1 each) but share words with each other:
    a resample that merged a conversation drawn twice into one unit would see its words as repetition (the
    interval [0.696, 0.833] around 1.000 of a run on short held-out conversations)."""
    texts = {"a": ["hi there", "you ok"], "b": ["hi you", "there ok"], "c": ["ok", "hi"]}
    obs = [{"unit": u, **features(t, "")} for u, turns in texts.items() for t in turns]
    distinct = M.BEHAVIOUR[next(m for m in M.BEHAVIOUR if m.name == "distinct_1")]
    assert M.bootstrap(obs, distinct, 200, seed=0) == (1.0, 1.0, 1.0)


def test_the_bootstrap_equals_one_computed_by_hand():
    # per-conversation distinct-1: a 1/2 ("x x"), b 2/2 ("y z"), c 2/4 ("u u u v")
    obs = [{"unit": u, "unigrams": words.split()} for u, words in [("a", "x"), ("a", "x"), ("b", "y z"),
                                                                   ("c", "u u"), ("c", "u v")]]
    distinct = M._distinct("unigrams")
    assert distinct(obs) == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    # the draws of random.Random(4).choices over the 3 conversations, 4 replicates, and each replicate's mean of
    # the drawn conversations' own ratios: a drawn twice counts twice (merged into one unit, "a a b" would be
    # (1/4 + 1) / 2 and "c c c" 2/12)
    rng = random.Random(4)
    assert ["".join(rng.choices("abc", k=3)) for _ in range(4)] == ["aab", "aab", "ccc", "aba"]
    replicates = [2 / 3, 2 / 3, 0.5, 2 / 3]
    # numpy's linear percentiles of the sorted [0.5, 2/3, 2/3, 2/3] at 2.5 and 97.5: ranks 0.075 and 2.925
    low, high = 0.5 + 0.075 * (2 / 3 - 0.5), 2 / 3
    assert M.bootstrap(obs, distinct, 4, seed=4) == pytest.approx((2 / 3, low, high))
    assert sorted(replicates)[0] < low < high == max(replicates)

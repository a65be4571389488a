"""τ-USI by hand: one conversation's features counted turn by turn, a dimension's Dice, the 5-bin difficulty ECE
and the index itself; then the echo simulator at 100 on every dimension of the real table."""

import pytest

from megatron_mimesis.eval import metrics as M
from megatron_mimesis.eval import usi
from megatron_mimesis.eval.calibration import difficulty_ece, task_difficulty, trial_difficulty_ece
from megatron_mimesis.eval.heldout import input_corpora, read_conversations
from tests.eval.conftest import AssistantSimulator, EchoSimulator
from tests.eval.test_metrics import table_of

HUMAN = ["Hi, I need to change my order #W2378156 please",  # 9 words; polite; ids: change, #w2378156, please
         "ok",  # 1 word: short, acknowledgement only
         "Are you sure? I already told you the date — it's wrong and I'm frustrated",  # 15; dash; pushback,
         # emotion, accusation; ids: already, frustrated
         "Actually, can we just cancel it instead?"]  # 7; pivot ("can we just", "instead"); ids: actually, cancel,
# instead
SIMULATOR = ["I'd like to change an order.", "Thanks!"]  # 6 and 1 words; a pivot ("i'd like"); polite; short


def test_one_conversations_features_by_hand():
    features = usi.conversation_features([usi.turn_signals(t) for t in HUMAN])
    assert features == pytest.approx({
        "politeness_rate": 1 / 4, "short_msg_rate": 1 / 4, "formality_rate": 1 / 4, "ack_only_rate": 1 / 4,
        "verbosity_cv": 5 / 8,  # words 9, 1, 15, 7: mean 8, population std sqrt((1 + 49 + 49 + 1) / 4) = 5
        "repeat_rate": 0.0, "id_confuse_rate": 0.0,
        "info_frontload": (9 + 1) / 32, "id_density": (3 + 0 + 2 + 3) / 4, "user_words_per_turn": 8.0,
        "opening_words": 9.0,
        "uncertainty_rate": 0.0, "certainty_rate": 0.0, "pushback_q_rate": 1 / 4, "clarify_q_rate": 0.0,
        "info_q_rate": 0.0,
        "emotion_rate": 1 / 4, "accusation_rate": 1 / 4, "pivot_rate": 1 / 4})
    assert usi.turn_signals("   ") is None and usi.conversation_features([None]) is None  # a bare stop marker


def test_a_dimension_is_the_mean_dice_of_its_features_and_the_index_adds_calibration():
    # D4 (emotion, accusation, pivot): simulator 0, 0, 1/2 against the humans' 1/4, 1/4, 1/4
    obs = [{"unit": "c", "usi": usi.turn_signals(s), "human_usi": usi.turn_signals(h)}
           for s, h in zip(SIMULATOR, HUMAN[:2], strict=True)]
    own = usi.conversation_features([o["usi"] for o in obs])
    human = usi.conversation_features([o["human_usi"] for o in obs])
    assert (own["pivot_rate"], human["pivot_rate"], human["emotion_rate"]) == (0.5, 0.0, 0.0)
    # at the same two positions the humans show no reaction at all: emotion and accusation agree (both 0 -> 1)
    assert M.usi_dimension("D4_react")(obs) == pytest.approx(100 * (1 + 1 + 0) / 3)
    whole = usi.conversation_features([usi.turn_signals(t) for t in HUMAN])
    assert usi.dimension_score("D4_react", own, whole) == pytest.approx(100 * (0 + 0 + 2 * 0.25 / 0.75) / 3)
    assert usi.dice(0.0, 0.0) == 1.0 and usi.dice(2.0, 6.0) == 0.5
    assert usi.tau_usi([80.0, 60.0, 70.0, 90.0], ece=0.25) == pytest.approx((80 + 60 + 70 + 90 + 75) / 5)


def test_the_difficulty_binned_ece_by_hand():
    difficulty = {"t1": 0.1, "t2": 0.15, "t3": 0.5, "t4": 0.9}  # bins 0, 0, 2, 4
    real = {"t1": 0.0, "t2": 0.5, "t3": 1.0, "t4": 0.5}
    # bin 0: |1/2 - 1/4| on 2 of 4 tasks; bin 2: |1 - 1| = 0; bin 4: |1 - 1/2| on 1 of 4
    assert difficulty_ece({"t1": 1.0, "t2": 0.0, "t3": 1.0, "t4": 1.0}, real, difficulty) == pytest.approx(0.25)
    # trial 2 scored t1, t2, t4: bin 0 |0 - 1/4| on 2 of 3, bin 4 |1 - 1/2| on 1 of 3; the mean of the two trials
    trials = {"t1": [1.0, 0.0], "t2": [0.0, 0.0], "t3": [1.0, None], "t4": [1.0, 1.0]}
    assert trial_difficulty_ece(trials, real, difficulty) == pytest.approx((0.25 + 1 / 3) / 2)
    assert difficulty_ece({"t9": 1.0}, real, difficulty) is None
    # difficulty: success pooled over the simulators' scored episodes, for tasks with 10 of them
    pooled = task_difficulty([{"t1": [1.0] * 5, "t2": [1.0] * 4 + [None]}, {"t1": [0.0] * 4 + [1.0], "t2": [0.0] * 5}])
    assert pooled == {"t1": 0.6}


def test_the_echo_simulator_scores_100_on_every_dimension(heldout_file, tmp_path):
    held_out = read_conversations(input_corpora([str(heldout_file)]))
    _, cells = table_of([EchoSimulator(), AssistantSimulator()], held_out, tmp_path)
    dimensions = [m.name for m in M.USI]
    assert all(cells["echo"][d]["value"] == pytest.approx(100.0) for d in dimensions)
    assert all(cells["human"][d]["value"] is None for d in dimensions)  # the humans against themselves: n/a
    assistant = [cells["assistant"][d]["value"] for d in dimensions]
    assert all(v < 90.0 for v in assistant[:2]), assistant  # polite, long, front-loaded, identifier-like words

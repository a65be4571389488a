"""Prompt files are validated up front with file:line in every error; the sampler honours weights, never repeats a
record within a domain epoch, and resumes onto exactly the prompts an uninterrupted run would draw."""

import json
from collections import Counter

import pytest

from megatron_mimesis.rl.simulator.prompts import Behavior, DomainSampler, PromptError, PromptRecord, load_prompts


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


GOOD = [
    {"id": "m1", "domain": "math", "prompt": "Ask about 2+2.", "reference": 4},
    {
        "id": "b1",
        "domain": "abcd",
        "prompt": "Book a flight.",
        "opening": "Hi! How can I help?",
        "behavior": {"name": "impatience", "description": "gets short with slow answers"},
    },
    {"id": "c1", "domain": "mc", "prompt": "Pick one.", "reference": ["B", "paris"]},
]


def test_load_valid_file(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], "", GOOD[1], GOOD[2]])
    records = load_prompts([path])
    assert records == [
        PromptRecord("m1", "math", "Ask about 2+2.", reference=4),
        PromptRecord(
            "b1",
            "abcd",
            "Book a flight.",
            opening="Hi! How can I help?",
            behavior=Behavior("impatience", "gets short with slow answers"),
        ),
        PromptRecord("c1", "mc", "Pick one.", reference=["B", "paris"]),
    ]


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"id": "x", "domain": ', "malformed JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"domain": "d", "prompt": "p"}, "field 'id' is missing"),
        ({"id": "x", "domain": "  ", "prompt": "p"}, "field 'domain' is empty"),
        ({"id": "x", "domain": "d", "prompt": 3}, "field 'prompt' must be a string, got int"),
        ({"id": "x", "domain": "d", "prompt": "p", "opening": ""}, "field 'opening' is empty"),
        ({"id": "x", "domain": "d", "prompt": "p", "reference": True}, "field 'reference' must be a string, number"),
        ({"id": "x", "domain": "d", "prompt": "p", "reference": []}, "field 'reference' is an empty list"),
        ({"id": "x", "domain": "d", "prompt": "p", "reference": [{}]}, "field 'reference' list items"),
        ({"id": "x", "domain": "d", "prompt": "p", "behavior": "rude"}, "field 'behavior' must be an object"),
        (
            {"id": "x", "domain": "d", "prompt": "p", "behavior": {"name": "rude"}},
            "field 'behavior.description' is missing",
        ),
        (
            {"id": "x", "domain": "d", "prompt": "p", "behavior": {"name": "", "description": "x"}},
            "field 'behavior.name' is empty",
        ),
        (
            {"id": "x", "domain": "d", "prompt": "p", "behavior": {"name": "a", "description": "b", "level": 2}},
            "field 'behavior' has unknown keys ['level']",
        ),
        ({"id": "x", "domain": "d", "prompt": "p", "answer": "4"}, "unknown fields ['answer']"),
        (GOOD[0], "field 'id' duplicates id 'm1' first seen at"),
    ],
)
def test_bad_record_names_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], "", bad])
    with pytest.raises(PromptError) as err:
        load_prompts([path])
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def test_duplicate_id_across_files(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [GOOD[0]])
    second = write_jsonl(tmp_path / "b.jsonl", [GOOD[1], GOOD[0]])
    with pytest.raises(PromptError, match=rf"^{second}:2: field 'id' duplicates id 'm1' first seen at {first}:1$"):
        load_prompts([first, second])


def test_empty_file_is_an_error(tmp_path):
    with pytest.raises(PromptError, match="no prompt records"):
        load_prompts([write_jsonl(tmp_path / "p.jsonl", [""])])


def records(domain, n):
    return [PromptRecord(f"{domain}{i}", domain, "p") for i in range(n)]


def test_no_repeat_within_an_epoch():
    sampler = DomainSampler(records("a", 5), None, seed=3)
    drawn = [r.id for r in sampler.sample(15)]
    for epoch in range(3):
        assert sorted(drawn[5 * epoch : 5 * epoch + 5]) == [f"a{i}" for i in range(5)]
    assert drawn[:5] != drawn[5:10] != drawn[10:]  # a fresh shuffle each epoch


def test_default_weights_follow_record_counts():
    sampler = DomainSampler(records("a", 30) + records("b", 10), None, seed=0)
    counts = Counter(r.domain for r in sampler.sample(4000))
    assert counts["a"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_explicit_weights_and_zero_weight():
    sampler = DomainSampler(records("a", 3) + records("b", 3) + records("c", 3), {"a": 1.0, "b": 3.0, "c": 0.0}, 1)
    counts = Counter(r.domain for r in sampler.sample(4000))
    assert counts["c"] == 0
    assert counts["b"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_weights_must_name_exactly_the_domains():
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['z'\]"):
        DomainSampler(records("a", 2) + records("b", 2), {"a": 1.0, "z": 1.0}, 0)
    with pytest.raises(ValueError, match="not all 0"):
        DomainSampler(records("a", 2), {"a": 0.0}, 0)


def test_resume_continues_with_the_same_prompts():
    pool = records("a", 7) + records("b", 4) + records("c", 2)
    reference = DomainSampler(pool, None, seed=11)
    first = reference.sample(10)
    state = json.loads(json.dumps(reference.state_dict()))  # survives a checkpoint round trip
    expected = reference.sample(25)

    resumed = DomainSampler(pool, None, seed=11)
    resumed.load_state_dict(state)
    assert [r.id for r in resumed.sample(25)] == [r.id for r in expected]
    assert [r.id for r in DomainSampler(pool, None, seed=11).sample(10)] == [r.id for r in first]


def test_resume_refuses_other_seed_or_prompts():
    state = DomainSampler(records("a", 3), None, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed 1"):
        DomainSampler(records("a", 3), None, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="domains/sizes"):
        DomainSampler(records("a", 4), None, seed=1).load_state_dict(state)

"""End to end: write with data_prep, read back through the trainer's dataset classes."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data_prep import pipeline
from data_prep.midtrain import build
from data_prep.sft import build as build_sft
from data_prep.shards import split_of
from data_prep.tokenizer import TextEncoder
from megatron_mimesis.data import (
    PackedConversationDataset,
    build_blended_datasets,
    collate_packed,
    packed_seq_params,
)
from tests.data.conftest import IM_END, NL, conversation, ids, write_jsonl

USER = [1, *ids("user\n")]


def build_jsonl(tmp_path, tokenizer_dir, records, **options):
    path = write_jsonl(tmp_path / "corpus.jsonl", records)
    options.setdefault("valid_fraction", 0.0)
    return build(inputs=[str(path)], output=str(tmp_path / "out"), tokenizer=str(tokenizer_dir), **options)


def test_packed_row_exact_item(tmp_path, char_tokenizer_dir):
    records = [conversation(("user", "hi"), ("assistant", "yo")), conversation(("user", "ok"))]
    result = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40, complete=[False])
    dataset = PackedConversationDataset(result.manifest["corpora"]["corpus"]["prefixes"]["train"])
    assert len(dataset) == 1 and dataset.seq_length == 40
    item = dataset[0]
    first = [*USER, *ids("hi"), IM_END, NL]
    second = [*USER, *ids("ok"), IM_END, NL]
    assert item["tokens"].tolist() == first + second + [0] * 20
    assert item["cu_seqlens"].tolist() == [0, 10, 20, 40] and item["cu_seqlens"].dtype == torch.int32
    assert item["position_ids"].tolist() == [*range(10), *range(10), *range(20)]
    assert item["labels"].tolist() == first[1:] + [0] + second[1:] + [0] + [0] * 20
    assert [i for i, m in enumerate(item["loss_mask"].tolist()) if m] == [5, 6, 7, 15, 16, 17]
    assert item["tokens"].dtype == item["labels"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32


def test_round_trip_decodes_original_user_turns(tmp_path):
    records = [
        conversation(("user", "Hello there!"), ("assistant", "Hi, who is this?"), ("user", "Your neighbour."), conversation_id="a"),
        conversation(("assistant", "How can I help?"), ("user", "Tell me a joke."), conversation_id="b"),
        conversation(("system", "Be brief."), ("user", "What time is it?"), conversation_id="c"),
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "talk.jsonl", records * 20)
    result = build(inputs=[str(path)], output=str(tmp_path / "out"), seq_length=128, vocab_size=512, valid_fraction=0.0)
    encoder = TextEncoder(result.output_dir / "tokenizer")
    dataset = PackedConversationDataset(result.output_dir / "talk" / "train")
    user_turns = []
    for row in range(len(dataset)):
        item = dataset[row]
        targets = item["labels"][item["loss_mask"].bool()].tolist()
        user_turns += [t for t in encoder.decode(targets).split("<|im_end|>") if t]
    # each conversation's last user turn is where the user left (a messages corpus is complete by default)
    expected = ["Hello there!", "Your neighbour. <END>", "Tell me a joke. <END>", "What time is it? <END>"]
    assert sorted(user_turns) == sorted(expected * 20)


def test_manifest_counts(tmp_path, char_tokenizer_dir):
    records = [conversation(("user", "hi"), ("assistant", "yo")), conversation(("user", "ok"))]
    result = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40, complete=[False])
    corpus = result.manifest["corpora"]["corpus"]
    assert corpus["documents_in"] == 2 and corpus["conversations"] == 2
    assert corpus["samples_out"] == {"train": 2, "valid": 0}
    assert corpus["tokens"] == {"train": 20, "valid": 0}
    assert corpus["loss_tokens"] == {"train": 6, "valid": 0}
    assert corpus["rows"] == {"train": 1, "valid": 0} and corpus["padding_tokens"] == {"train": 20, "valid": 0}
    assert corpus["skipped"] == {} and corpus["dropped"] == {"no_target_turn": 0, "overlong_target_turns": 0}
    assert corpus["seq_length"] == 40 and corpus["thinking"] == "off"
    assert len(corpus["source"]["sha256"]) == 64 and len(corpus["tokenizer"]["sha256"]) == 64
    assert json.loads((result.output_dir / "corpus" / "manifest.json").read_text()) == corpus
    assert json.loads((result.output_dir / "mixture.json").read_text()) == {
        "train": ["20", corpus["prefixes"]["train"]]
    }


def test_overlong_target_is_reported(tmp_path, char_tokenizer_dir):
    records = [conversation(("user", "x" * 50), ("assistant", "yo"), ("user", "ok"))]
    corpus = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40).manifest["corpora"]["corpus"]
    assert corpus["dropped"]["overlong_target_turns"] == 1 and corpus["samples_out"]["train"] == 1


def test_split_is_by_conversation_id(tmp_path, char_tokenizer_dir):
    assert split_of("conversation-7", 0.5) == split_of("conversation-7", 0.5)
    share = sum(split_of(f"c{i}", 0.1) == "valid" for i in range(20000)) / 20000
    assert 0.09 < share < 0.11
    records = [conversation(("user", "hi"), ("assistant", "yo"), conversation_id=f"c{i}") for i in range(40)]
    corpus = build_jsonl(
        tmp_path, char_tokenizer_dir, records, seq_length=40, valid_fraction=0.5, user_speaker="both"
    ).manifest["corpora"]["corpus"]
    valid = sum(split_of(f"c{i}", 0.5) == "valid" for i in range(40))
    # both speakers -> two samples per conversation, always in the same split
    assert corpus["samples_out"] == {"train": 2 * (40 - valid), "valid": 2 * valid}
    assert 0 < valid < 40


def test_reuse_resume_and_rebuild(tmp_path, char_tokenizer_dir, monkeypatch):
    records = [conversation(("user", f"hi{'!' * i}"), ("assistant", "yo"), conversation_id=f"c{i}") for i in range(7)]
    monkeypatch.setattr(pipeline, "RECORDS_PER_SHARD", 2)
    calls = []
    real = pipeline.process_shard

    def dies_on_third_shard(stem, records, settings):
        calls.append(stem[-6:])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(stem, records, settings)

    monkeypatch.setattr(pipeline, "process_shard", dies_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40)
    assert not (tmp_path / "out" / "manifest.json").exists()

    calls.clear()
    monkeypatch.setattr(pipeline, "process_shard", lambda *a: calls.append(a[0][-6:]) or real(*a))
    first = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40)
    assert calls == ["000002", "000003"] and not first.reused
    assert first.manifest["corpora"]["corpus"]["samples_out"]["train"] == 7

    again = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40)
    assert again.reused and again.manifest == first.manifest and calls == ["000002", "000003"]
    changed = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=48)
    assert not changed.reused and changed.manifest["seq_length"] == 48


def test_parquet_sharegpt_and_two_workers(tmp_path, char_tokenizer_dir):
    rows = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "id": f"p{i}"}
        for i in range(1100)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "share.parquet")
    write_jsonl(tmp_path / "other.jsonl", [{"conversations": rows[0]["conversations"]}])
    result = build(
        inputs=[str(tmp_path / "share.parquet"), str(tmp_path / "other.jsonl")],
        output=str(tmp_path / "out"),
        tokenizer=str(char_tokenizer_dir),
        record_format="sharegpt",
        seq_length=40,
        workers=2,
        valid_fraction=0.0,
        weights=[3.0, 1.0],
    )
    corpora = result.manifest["corpora"]
    assert corpora["share"]["samples_out"]["train"] == 1100 and corpora["other"]["samples_out"]["train"] == 1
    mixture = json.loads((result.output_dir / "mixture.json").read_text())
    assert mixture == {
        "train": ["3.0", corpora["share"]["prefixes"]["train"], "1.0", corpora["other"]["prefixes"]["train"]]
    }


def test_datasets_directory_with_column_mapping(tmp_path, char_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "hubset").mkdir()
    write_jsonl(tmp_path / "hubset" / "train.jsonl", [{"dialog": [{"speaker": "user", "text": "hi"}]}])
    result = build(
        inputs=[str(tmp_path / "hubset")],
        output=str(tmp_path / "out"),
        tokenizer=str(char_tokenizer_dir),
        messages_field="dialog",
        role_field="speaker",
        content_field="text",
        seq_length=40,
        valid_fraction=0.0,
    )
    assert result.manifest["corpora"]["hubset"]["samples_out"]["train"] == 1


def test_collate_flattens_boundaries_for_thd(tmp_path, char_tokenizer_dir):
    records = [conversation(("user", "hi"), ("assistant", "yo")), conversation(("user", "ok"))]
    built = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40, complete=[False])
    prefix = built.manifest["corpora"]["corpus"]["prefixes"]
    row = PackedConversationDataset(prefix["train"])[0]
    batch = collate_packed([row, row])
    assert batch["tokens"].shape == (2, 40) and batch["loss_mask"].shape == (2, 40)
    assert batch["cu_seqlens"].tolist() == [0, 10, 20, 40, 50, 60, 80] and batch["max_seqlen"] == 20
    params = packed_seq_params(batch)
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 20
    assert params.cu_seqlens_q is params.cu_seqlens_kv is batch["cu_seqlens"]


def test_blended_train_and_valid_from_mixture(tmp_path, char_tokenizer_dir):
    for name, n in (("big", 60), ("small", 20)):
        write_jsonl(
            tmp_path / f"{name}.jsonl",
            [conversation(("user", "hi" * (1 + i % 3)), conversation_id=f"{name}{i}") for i in range(n)],
        )
    result = build(
        inputs=[str(tmp_path / "big.jsonl"), str(tmp_path / "small.jsonl")],
        output=str(tmp_path / "out"),
        tokenizer=str(char_tokenizer_dir),
        seq_length=32,
        valid_fraction=0.3,
    )
    train, valid = build_blended_datasets(result.output_dir / "mixture.json", 32, train_samples=200, valid_samples=10)
    assert len(train) >= 200 and len(valid) >= 10
    ids_seen = [int(train[i]["dataset_id"]) for i in range(200)]
    big_share = result.manifest["corpora"]["big"]["tokens"]["train"] / sum(
        c["tokens"]["train"] for c in result.manifest["corpora"].values()
    )
    assert abs(ids_seen.count(0) / 200 - big_share) < 0.05
    assert train[0]["tokens"].shape == (32,) and int(train[0]["cu_seqlens"][-1]) == 32


def test_the_same_data_built_elsewhere_trains_in_the_same_order(tmp_path, char_tokenizer_dir):
    write_jsonl(tmp_path / "talk.jsonl",
                [conversation(("user", "hi" * (1 + i % 5)), conversation_id=f"c{i}") for i in range(60)])
    orders = []
    for where in ("here", "there/deeper"):  # e.g. the same corpus prepared on two filesystems
        result = build(inputs=[str(tmp_path / "talk.jsonl")], output=str(tmp_path / where / "out"),
                       tokenizer=str(char_tokenizer_dir), seq_length=32, valid_fraction=0.2)
        train, _ = build_blended_datasets(result.output_dir / "mixture.json", 32, train_samples=40, valid_samples=4)
        orders.append([train[i]["tokens"].tolist() for i in range(40)])
    assert orders[0] == orders[1]


def test_embedded_midtrain_default_subset(tmp_path):
    result = build(output=str(tmp_path / "chat"), max_conversations=40, seq_length=1024)
    manifest = result.manifest
    corpus = manifest["corpora"]["chitchat"]
    assert corpus["documents_in"] == 40 and corpus["user_speaker"] == "both"
    assert manifest["tokenizer"]["trained_here"] and manifest["tokenizer"]["vocab_size"] <= 4096
    assert build(output=str(tmp_path / "chat"), max_conversations=40, seq_length=1024).reused
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(result.output_dir / "tokenizer"))
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_embedded_sft_demo_is_marked_synthetic(tmp_path):
    result = build_sft(output=str(tmp_path / "sft"), max_conversations=20, seq_length=1024)
    corpus = result.manifest["corpora"]["chitchat"]
    assert corpus["thinking"].startswith("synthetic") and corpus["samples_out"]["train"] > 0
    encoder = TextEncoder(result.output_dir / "tokenizer")
    item = PackedConversationDataset(corpus["prefixes"]["train"])[0]
    target = encoder.decode(item["labels"][item["loss_mask"].bool()].tolist())
    assert target.startswith("<think>\n") and "\n</think>\n\n" in target and target.endswith("<|im_end|>")


def test_packing_groups_of_shards(tmp_path, char_tokenizer_dir, monkeypatch):
    # 5 one-record shards packed in groups of 2 shards: rows never mix groups, every sample is written once
    monkeypatch.setattr(pipeline, "RECORDS_PER_SHARD", 1)
    monkeypatch.setattr(pipeline, "SHARDS_PER_PACKING_GROUP", 2)
    records = [conversation(("user", "hi"), ("assistant", "yo")) for _ in range(5)]
    corpus = build_jsonl(tmp_path, char_tokenizer_dir, records, seq_length=40, complete=[False]).manifest["corpora"]
    corpus = corpus["corpus"]
    assert corpus["rows"]["train"] == 3 and corpus["padding_tokens"]["train"] == 3 * 40 - 5 * 10
    dataset = PackedConversationDataset(corpus["prefixes"]["train"])
    assert [dataset[i]["cu_seqlens"].tolist() for i in range(3)] == [[0, 10, 20, 40], [0, 10, 20, 40], [0, 10, 40]]


def test_end_targets_per_corpus_with_completeness_per_input(tmp_path, char_tokenizer_dir):
    """The manifest counts, per corpus, the renderings whose last user turn ends the conversation and why the
    others do not; ``complete`` is one answer per input, and a sharegpt corpus is not complete unless told."""
    records = [conversation(("user", "hi"), ("assistant", "yo"), ("user", "ok")),
               conversation(("assistant", "yo"), ("user", "ok")),
               conversation(("user", "hi"), ("assistant", "yo"), ("user", "x" * 60))]
    whole = write_jsonl(tmp_path / "whole.jsonl", records)
    cut = write_jsonl(tmp_path / "cut.jsonl", records)
    result = build(inputs=[str(whole), str(cut)], output=str(tmp_path / "out"), tokenizer=str(char_tokenizer_dir),
                   seq_length=40, valid_fraction=0.0, complete=[True, False])
    corpora = result.manifest["corpora"]
    assert corpora["whole"]["complete"] and corpora["whole"]["end_marker"] == "<END>"
    assert corpora["whole"]["end_targets"] == {"ended": 2, "source_incomplete": 0, "last_turn_overlong": 1,
                                               "last_turn_unsupervised": 0}
    assert corpora["cut"]["end_targets"] == {"ended": 0, "source_incomplete": 3, "last_turn_overlong": 0,
                                             "last_turn_unsupervised": 0}
    # the marked corpus has one more target per ended conversation: " <END>" (6 characters) each
    assert sum(corpora["whole"]["loss_tokens"].values()) == sum(corpora["cut"]["loss_tokens"].values()) + 2 * 6
    assert pipeline.PrepConfig(inputs=["a.json"], record_format="sharegpt").resolved_complete() == [False]
    assert pipeline.PrepConfig(inputs=["a.json", "b.json"]).resolved_complete() == [True, True]
    with pytest.raises(pipeline.PrepError, match="--complete needs one yes/no per input, got 1"):
        pipeline.PrepConfig(inputs=["a.json", "b.json"], complete=[True])

"""Retention: the rule (the newest ``keep_last_n``, the multiples of ``keep_every``), what the plan derives from it,
and the saver applying it to real checkpoint directories only once the newly published one verifies."""

import pytest

from megatron_mimesis.checkpoint.integrity import record_files
from megatron_mimesis.checkpoint.reader import CheckpointError, checkpoint_dir, published_iterations
from megatron_mimesis.checkpoint.retention import DELETING_SUFFIX, deletable, most_on_disk
from megatron_mimesis.checkpoint.trainer_state import CheckpointSaver


def test_the_rule_keeps_the_newest_n_and_the_multiples_and_leaves_newer_ones_alone():
    assert deletable([1, 2, 3, 4, 5], 5, None, None) == []  # no keep_last_n: everything is kept
    assert deletable([1, 2, 3, 4, 5], 5, 2, None) == [3, 2, 1]
    assert deletable([1, 2, 3, 4, 5], 5, 1, None) == [4, 3, 2, 1]
    assert deletable([2, 4, 6, 8, 10, 12], 12, 2, 4) == [6, 2]  # 10 in the window; 8 and 4 kept for evaluation
    assert deletable([1, 2, 7, 9], 2, 1, None) == [1]  # 7 and 9: another run's, which this one overwrote


def test_the_plan_counts_the_new_checkpoint_before_the_old_one_goes():
    saves = list(range(200, 4801, 200)) + [4837]  # the mid-training run: every 200 of 4837 steps
    assert most_on_disk(saves, None, None) == 25
    assert most_on_disk(saves, 2, None) == 3
    assert most_on_disk(saves, 2, 1000) == 7  # and 1000, 2000, 3000, 4000 kept for evaluation
    assert most_on_disk([10], 3, None) == 1


def _checkpoints(root, iterations):
    for iteration in iterations:
        directory = checkpoint_dir(root, iteration)
        directory.mkdir(parents=True)
        (directory / "__0_0.distcp").write_bytes(bytes(100 + iteration))
        record_files(directory)


def test_the_saver_deletes_only_after_the_published_checkpoint_verifies(tmp_path):
    _checkpoints(tmp_path, [1, 2, 3, 4, 5, 6])
    saver = CheckpointSaver(tmp_path, asynchronous=False, keep_last_n=2, keep_every=2)
    (checkpoint_dir(tmp_path, 6) / "__0_0.distcp").write_bytes(b"")  # lost on the way to the disk
    with pytest.raises(CheckpointError, match=r"iter_0000006/__0_0\.distcp: 0 bytes, 106 were saved \(truncated\); "
                                              r"no older checkpoint deleted$"):
        saver._retire_older(6)
    assert published_iterations(tmp_path) == [1, 2, 3, 4, 5, 6]  # the others are all still there

    _checkpoints(tmp_path, [7])
    (checkpoint_dir(tmp_path, 5) / "__0_0.distcp").write_bytes(b"")  # a damaged older one: not counted, not deleted
    (tmp_path / f"iter_0000001{DELETING_SUFFIX}").mkdir()  # a deletion a kill interrupted
    saver._retire_older(7)
    # 7 and the newest complete one before it (4: 5 and 6 are damaged, neither counted nor deleted); 2, a multiple of
    # keep_every
    assert published_iterations(tmp_path) == [2, 4, 5, 6, 7]
    assert not list(tmp_path.glob(f"*{DELETING_SUFFIX}"))

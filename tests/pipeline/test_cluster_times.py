"""SLURM's time strings as sbatch(1) documents them ("minutes", "minutes:seconds", "hours:minutes:seconds",
"days-hours", "days-hours:minutes", "days-hours:minutes:seconds"), read and written by the chain (a server's limit is
the sum of its readers', a reader compares what its server has left with its own)."""

import pytest

from megatron_mimesis.pipeline import cluster


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("10:30", 630), ("04:00:00", 14400), ("1-12", 129600), ("1-12:30", 131400),
    ("2-00:00:00", 172800), ("UNLIMITED", None), ("INFINITE", None)])
def test_every_form_of_a_slurm_time_reads_as_sbatch_documents_it(text, seconds):
    assert cluster.seconds(text) == seconds


def test_a_time_written_reads_back_and_what_is_left_is_the_limit_less_the_run_time():
    assert cluster.time_text(2 * 86400 + 86400 + 1800) == "3-00:30:00"
    assert cluster.seconds(cluster.time_text(98765)) == 98765
    assert cluster.remaining_s({"TimeLimit": "00:20:00", "RunTime": "00:05:30"}) == 870
    assert cluster.remaining_s({"TimeLimit": "UNLIMITED", "RunTime": "1-00:00:00"}) is None
    with pytest.raises(ValueError, match="not a SLURM time"):
        cluster.seconds("two days")

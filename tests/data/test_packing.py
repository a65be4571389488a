"""Best-fit decreasing packing."""

import pytest

from data_prep.packing import pack


def test_best_fit_decreasing_rows():
    # longest first: 8 -> row 0 (room 2), 6 -> row 1 (room 4), 5 -> row 2 (room 5),
    # 3 -> fullest row with room: row 1 (room 1), 2 -> row 0 (room 0)
    assert pack([5, 3, 8, 2, 6], 10) == [[2, 3], [4, 1], [0]]


def test_ties_keep_input_order_and_full_rows_close():
    assert pack([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]


def test_sample_longer_than_row_is_an_error():
    with pytest.raises(ValueError, match="sample 1 has 11 tokens"):
        pack([3, 11], 10)

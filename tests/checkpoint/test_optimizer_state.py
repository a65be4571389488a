"""A rank's flat slice of a parameter as N-D boxes (``optimizer_state.flat_range_boxes``): the boxes' elements, read
out of the tensor in order, are exactly the slice, whatever the shape and the slice."""

import itertools
import math

import pytest
import torch

from megatron_mimesis.checkpoint.optimizer_state import flat_range_boxes


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 1, 6), (3, 4, 2, 5), (1, 9)])
def test_the_boxes_of_every_flat_range_are_that_range_in_order(shape):
    tensor = torch.arange(math.prod(shape)).reshape(shape)
    for start, stop in itertools.combinations(range(math.prod(shape) + 1), 2):
        boxes = flat_range_boxes(shape, start, stop)
        read = [tensor[tuple(slice(o, o + s) for o, s in zip(offset, size, strict=True))].reshape(-1)
                for offset, size in boxes]
        assert torch.equal(torch.cat(read), torch.arange(start, stop)), (shape, start, stop, boxes)
        assert len(boxes) <= 2 * len(shape) - 1  # a partial row each side of the whole ones, recursively


def test_an_empty_range_has_no_boxes():
    assert flat_range_boxes((4, 4), 5, 5) == []

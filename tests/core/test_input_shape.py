"""One reader of per-sample input shapes for the CLI, the API and the pytest plugin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memsave_cli.errors import MemsaveError
from memsave_cli.input_shape import read_shape


@pytest.mark.parametrize(
    ("given", "shape"),
    [
        (None, None),
        ("3,224,224", (3, 224, 224)),
        ("3x224x224", (3, 224, 224)),
        ("3 × 8", (3, 8)),
        (" 3, 8 ", (3, 8)),
        ("3 8", (3, 8)),
        (16, (16,)),
        ([3, 8], (3, 8)),
        (torch.Size([3, 8]), (3, 8)),
        (np.array([3, 8]), (3, 8)),
        ((np.int64(3), torch.tensor(8)), (3, 8)),
    ],
)
def test_shapes_read(given: object, shape: tuple[int, ...] | None) -> None:
    assert read_shape(given) == shape


@pytest.mark.parametrize(
    "given",
    ["", "3,,8", "3,", ",3", "3,0", "3,-1", "a,b", "3,²", 0, -2, 3.5, (3.0, 8), (True,), (), [[3]]],
)
def test_non_shapes_are_one_error(given: object) -> None:
    with pytest.raises(MemsaveError, match="is not a shape: expected positive sizes"):
        read_shape(given)

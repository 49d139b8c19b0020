"""Compare PyTorch's own ``module_db`` samples of one module class, stock against converted.

Run by ``test_module_db.py`` in a process of its own, so that a sample that kills the process (a
signal inside a kernel) is reported as that sample's failure instead of taking the test run down:

    python module_db_worker.py RESULTS SKIP NAME [NAME ...]

Each ``NAME`` is a ``module_db`` entry's formatted name (``nn_ReLU``); one process serves them
all, since importing ``module_db`` costs seconds. Before each sample the worker appends
``{"name": ..., "key": ..., "state": "start"}`` to the file ``RESULTS``, after it the same with
``"diffs": [...]`` instead of the state; a start without its end names the sample that crashed.
The first ``SKIP`` samples are passed over (the parent restarts a crashed worker after its
sample).
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.testing._internal.common_modules import ModuleInfo, module_db

from memsave_cli.exactness import PATTERNS, compare
from memsave_cli.kernels import native

DTYPES = (torch.float32, torch.float64)
#: The eager CPU code paths of the drop-ins (the layer tests' ``kernels`` fixture names the same).
PATHS = ("native", "torch")


def entry(name: str) -> ModuleInfo:
    """The ``module_db`` entry called ``name``."""
    return next(info for info in module_db if info.formatted_name == name)


@contextlib.contextmanager
def code_path(path: str) -> Iterator[None]:
    """Run the drop-ins on one eager CPU path: the native C kernels or torch ops."""
    saved = native.available
    if path == "torch":
        native.available = lambda: False
    try:
        yield
    finally:
        native.available = saved


def samples(info: ModuleInfo) -> Iterator[tuple[str, object, object]]:
    """``(key, build, make_inputs, pattern)`` for every sample, dtype, mode and pattern."""
    for dtype in DTYPES:
        for training in (True, False):
            torch.manual_seed(0)
            inputs = info.module_inputs_func(
                info, device="cpu", dtype=dtype, requires_grad=False, training=training
            )
            for i, sample in enumerate(inputs):
                mode = "train" if training else "eval"
                label = f"{str(dtype)[6:]}-{mode}-{i}:{sample.desc or 'default'}"
                build = _builder(info, sample.constructor_input, dtype, training)
                make = _input_maker(sample.forward_input)
                for pattern in PATTERNS:
                    yield f"{label}-{pattern}", build, make, pattern


def _builder(info: ModuleInfo, constructor, dtype: torch.dtype, training: bool):
    def build():
        torch.manual_seed(0)
        module = info.module_cls(*constructor.args, **constructor.kwargs)
        return module.to(dtype).train(training)

    return build


def _input_maker(forward):
    """Fresh copies of a sample's forward inputs, in their own layout (deepcopy keeps strides)."""

    def make():
        return copy.deepcopy(forward.args), copy.deepcopy(forward.kwargs)

    return make


def main(results: str, skip: int, names: list[str]) -> None:
    index = 0
    with Path(results).open("a") as out:
        for name in names:
            for path in PATHS:
                with code_path(path):
                    for key, build, make, pattern in samples(entry(name)):
                        index += 1
                        if index <= skip:
                            continue
                        record = {"name": name, "key": f"{path}-{key}"}
                        _emit(out, {**record, "state": "start"})
                        _emit(out, {**record, "diffs": compare(build, make, pattern)})


def _emit(out, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])

"""Which memsave drop-in replaces which stock module: filled by the ``@drop_in`` decorator."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from memsave_cli.errors import MemsaveError
from memsave_cli.layers.parametrized import evaluated_once

#: Exact stock class -> its memsave drop-in. Subclasses convert only when plain (NOTE [plain
#: subclasses] in ``subclassed.py``).
DROP_INS: dict[type[nn.Module], type[nn.Module]] = {}


def drop_in(stock: type[nn.Module]) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Register the decorated class as the memsave replacement of ``stock``.

    The drop-in must subclass ``stock`` and override ``forward`` only, so that parameters, buffers,
    ``state_dict`` keys and ``repr`` stay the stock ones.
    """

    def register(cls: type[nn.Module]) -> type[nn.Module]:
        if not issubclass(cls, stock):
            raise TypeError(f"{cls.__name__} must subclass {stock.__name__} to replace it")
        if stock in DROP_INS:
            raise TypeError(f"{stock.__name__} already has a drop-in: {DROP_INS[stock].__name__}")
        DROP_INS[stock] = cls
        evaluated_once(cls)  # NOTE [parametrized layers]
        cls.__prepare_scriptable__ = refuse_scripting
        return cls

    return register


class ScriptingError(MemsaveError, RuntimeError):
    """``torch.jit.script`` was given a memsave drop-in."""


def refuse_scripting(self: nn.Module) -> nn.Module:
    """``torch.jit.script`` calls this on every module before compiling it: a drop-in's forward
    is Python TorchScript cannot compile, and returning a stock copy would make the scripting
    replace the drop-in in the caller's model too, so the answer is one clear error."""
    raise ScriptingError(
        f"torch.jit.script cannot compile {type(self).__name__}, a memsave layer: script the "
        "stock model instead (memsave_cli.layers.revert(model)); torch.jit.trace, torch.export "
        "and torch.compile take converted models"
    )

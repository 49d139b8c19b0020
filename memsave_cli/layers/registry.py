"""Which memsave drop-in replaces which stock module: filled by the ``@drop_in`` decorator."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

#: Exact stock class -> its memsave drop-in. Only exact types are converted, never subclasses.
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
        return cls

    return register

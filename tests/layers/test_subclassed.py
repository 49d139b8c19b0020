"""Plain subclasses of stock layers convert as their stock class (NOTE [plain subclasses]); any
subclass that may compute otherwise stays stock."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from memsave_cli.layers import convert, converted_counts, revert
from memsave_cli.layers.conv import MemSaveConv2d
from memsave_cli.layers.registry import DROP_INS


class PlainConv(nn.Conv2d):
    """torchvision's video convolutions' shape: a constructor, a static helper, a constant."""

    kind = "plain"

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, padding=1, bias=False)

    @staticmethod
    def stride_of() -> int:
        return 1

    def fuse(self) -> None:
        """A method of its own that no forward calls."""


class PlainerConv(PlainConv):
    """A plain subclass of a plain subclass."""


class PlainNorm(nn.BatchNorm2d):
    pass


class PlainReLU(nn.ReLU):
    def __init__(self) -> None:
        super().__init__(inplace=True)


class PlainPool(nn.MaxPool2d):
    def __init__(self) -> None:
        super().__init__(3, stride=2, padding=1)


class PlainDropout(nn.Dropout):
    pass


def plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        PlainNorm(8),
        PlainReLU(),
        PlainConv(8),
        PlainNorm(8),
        PlainReLU(),
        PlainPool(),
        PlainerConv(8),
        PlainDropout(0.0),
    )


class Mixin:
    def helper(self) -> int:
        return 1


class OwnForward(nn.Conv2d):
    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) + 1


class OwnConvForward(nn.Conv2d):
    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.conv2d(input, weight.sign(), bias, self.stride, self.padding)


class OwnRepr(nn.Conv2d):
    def extra_repr(self) -> str:
        return "mine"


class OwnVersion(nn.BatchNorm2d):
    _version = 7


class OwnProperty(nn.Conv2d):
    @property
    def scale(self) -> float:
        return 2.0


class MixinFirst(Mixin, nn.Conv2d):
    pass


class MixinLast(nn.Conv2d, Mixin):
    pass


class OfADropIn(MemSaveConv2d):
    pass


class Meta(type(nn.Module)):
    pass


class OwnMetaclass(nn.Conv2d, metaclass=Meta):
    pass


class OverPlainForward(PlainConv):
    """A plain class's subclass with its own forward: stays stock."""

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) * 2


def _step(model: nn.Module, x: Tensor) -> list[Tensor]:
    leaf = x.clone().requires_grad_(True)
    output = model(leaf)
    output.square().sum().backward()
    return [output, leaf.grad, *(p.grad for p in model.parameters()), *model.buffers()]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_plain_subclasses_convert_and_compute_stocks_results(mode: str) -> None:
    stock = plain_model().train(mode == "train")
    converted = convert(stock)
    for before, after in zip(stock.modules(), converted.modules(), strict=True):
        if type(before) is not nn.Sequential:
            assert type(after) is not type(before) and isinstance(after, type(before))
    x = torch.randn(2, 3, 9, 11)
    for expected, actual in zip(_step(stock, x), _step(converted, x), strict=True):
        assert torch.equal(expected, actual)


def test_the_drop_in_forward_runs_and_saves_less() -> None:
    """A frozen plain convolution keeps no input, as its stock class's drop-in."""
    conv = PlainConv(4).requires_grad_(False)
    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    saved = {}
    for name, module in (("stock", conv), ("memsave", convert(conv))):
        sizes: list[int] = []

        def pack(tensor: Tensor, sizes: list[int] = sizes) -> Tensor:
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        saved[name] = sum(sizes)
    assert saved["memsave"] < saved["stock"]


@pytest.mark.parametrize(
    "cls",
    [
        OwnForward,
        OwnConvForward,
        OwnRepr,
        OwnProperty,
        MixinFirst,
        MixinLast,
        OfADropIn,
        OwnMetaclass,
        OverPlainForward,
    ],
)
def test_subclasses_that_may_compute_otherwise_stay(cls: type[nn.Module]) -> None:
    module = cls(8) if issubclass(cls, PlainConv) else cls(4, 4, 3)
    assert type(convert(module)) is cls
    assert converted_counts(convert(module)) == {}


def test_a_subclass_with_its_own_class_constant_of_stock_stays() -> None:
    assert type(convert(OwnVersion(4))) is OwnVersion


def test_revert_gives_the_subclass_back() -> None:
    stock = plain_model()
    reverted = revert(convert(stock))
    assert [type(m) for m in reverted.modules()] == [type(m) for m in stock.modules()]
    assert converted_counts(reverted) == {}


def test_counted_and_selected_as_their_stock_class() -> None:
    """Counted by their own name; ``include`` selects them with their stock class."""
    counts = converted_counts(convert(plain_model()))
    assert counts == {
        "Conv2d": 1,
        "PlainNorm": 2,
        "PlainReLU": 2,
        "PlainConv": 1,
        "PlainPool": 1,
        "PlainerConv": 1,
        "PlainDropout": 1,
    }
    assert converted_counts(convert(plain_model(), include="batchnorm")) == {"PlainNorm": 2}
    assert converted_counts(convert(plain_model(), include=[nn.Conv2d])) == {
        "Conv2d": 1,
        "PlainConv": 1,
        "PlainerConv": 1,
    }


def test_one_class_per_subclass_and_converting_twice_changes_nothing() -> None:
    model = convert(plain_model())
    assert type(model[1]) is type(model[4])
    again = convert(model)
    assert [type(m) for m in again.modules()] == [type(m) for m in model.modules()]


def test_pickles_deep_copies_and_saves_whole() -> None:
    model = convert(plain_model())
    assert type(model[3]).__mro__[1:3] == (MemSaveConv2d, PlainConv)  # a created class
    x = torch.randn(1, 3, 8, 8)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [
        pickle.loads(pickle.dumps(model)),
        copy.deepcopy(model),
        torch.load(buffer, weights_only=False),
    ]
    for other in copies:
        assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()]
        assert torch.equal(other(x), expected)


def test_a_parametrized_plain_subclass_converts_and_reverts_with_its_parametrization() -> None:
    torch.manual_seed(0)
    stock = parametrizations.weight_norm(PlainConv(4))
    converted = convert(stock)
    assert parametrize.is_parametrized(converted)
    assert isinstance(converted, DROP_INS[nn.Conv2d]) and isinstance(converted, PlainConv)
    x = torch.randn(2, 4, 6, 6)
    for expected, actual in zip(_step(stock, x), _step(converted, x), strict=True):
        assert torch.equal(expected, actual)
    reverted = revert(converted)
    assert type(reverted).__bases__ == (PlainConv,)

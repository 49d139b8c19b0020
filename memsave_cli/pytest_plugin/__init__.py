"""The ``memsave`` pytest plugin: memory budgets of a training step, asserted inside a test suite.

::

    def test_resnet_fits(memsave):
        memsave.assert_fits("torchvision:resnet18", budget="1.5GiB", case="input", batch_size=16)

    def test_memsave_pays_off(memsave):
        memsave.assert_saves("torchvision:resnet18", at_least=0.2, case="input", batch_size=16)

    @pytest.mark.memsave_budget("torchvision:resnet18", budget="1.5GiB", case="input")
    def test_training(): ...

Registered through the ``pytest11`` entry point, so installing memsave-cli is enough. Models are
measured by the same core as ``memsave profile`` (``memsave_cli.measure``), with the same options
as keyword arguments (``trainable=``, ``input_grad=``, ``dtype=``, ``lora_rank=``, ...): on the
meta device by default, an exact estimate that needs no GPU and takes a second or two, or for
real with ``device="cuda"``. A failed assertion reads like pytest's own: the peak, the budget
and the layers keeping most. What ``memsave profile`` would note under its numbers (parts of the
model the inputs do not run) becomes a :class:`MemsaveNote` warning, listed after the run.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import warnings
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import pytest

from memsave_cli.budget import read_size
from memsave_cli.errors import MemsaveError
from memsave_cli.pytest_plugin._note import MemsaveNote

if TYPE_CHECKING:
    from memsave_cli.pytest_plugin._measure import ModelLike
    from memsave_cli.pytest_plugin._settings import Settings
    from memsave_cli.report import Run

__all__ = ["MARKER", "MemsaveFixture", "MemsaveNote", "Settings", "memsave"]


def __getattr__(name: str) -> Any:
    """``Settings``, imported once asked for: pytest imports this module in every session of
    the environment, which should not wait for torch until a test measures."""
    if name == "Settings":
        from memsave_cli.pytest_plugin._settings import Settings

        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The marker form of ``assert_fits`` and ``assert_saves``.
MARKER = "memsave_budget"


def _notes_once(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` issuing each distinct MemsaveNote once, as raised by its caller's line: the
    stock and memsave measurements of ``assert_saves`` note the same things, and a note pointed
    into the plugin, not at the test. Other warnings pass on, each once per place."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        with _notes_after(stacklevel=5):  # _reissue, _notes_after, contextlib, wrapper, caller
            return method(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _notes_after(**place: Any) -> Iterator[None]:
    """Every warning of the body, recorded, then issued again once each (:func:`_reissue`,
    where ``place`` says). Where the body failed, its failure stays the error, also when
    warning filters turn a note into one."""
    __tracebackhide__ = True
    failure = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except BaseException as error:
            failure = error
    if failure is None:
        _reissue(caught, **place)
        return
    with contextlib.suppress(Warning):
        _reissue(caught, **place)
    raise failure


def _reissue(
    caught: list[warnings.WarningMessage],
    *,
    stacklevel: int = 3,
    at: tuple[str, int] | None = None,
) -> None:
    """Issue ``caught`` again, each distinct one once: a MemsaveNote by its text, as raised
    ``stacklevel`` frames up or at the file and line ``at``; any other by its text and place."""
    seen: set[tuple] = set()
    for found in caught:
        note = issubclass(found.category, MemsaveNote)
        where = () if note else (found.filename, found.lineno)
        key = (found.category, str(found.message), *where)
        if key in seen:
            continue
        seen.add(key)
        if not note:
            warnings.warn_explicit(
                found.message, found.category, found.filename, found.lineno, source=found.source
            )
        elif at is not None:
            warnings.warn_explicit(found.message, found.category, *at)
        else:
            warnings.warn(found.message, stacklevel=stacklevel)


class MemsaveFixture:
    """What the ``memsave`` fixture gives a test: measure a model, assert its budget or savings."""

    @_notes_once
    def measure(self, model: ModelLike, *, impl: str = "memsave", **settings: Any) -> Run:
        """One training step of ``model`` with ``impl`` layers (a Run, as ``memsave profile``'s).

        ``model`` is a spec string (``"torchvision:resnet18"``, ``"pkg.models:build"``), an
        ``nn.Module`` (copied, never changed) or a function building one. Settings are those of
        :class:`Settings`, the options of ``memsave profile``. Settings that cannot work fail the
        test with one line, as the CLI reports them.
        """
        __tracebackhide__ = True
        from memsave_cli.pytest_plugin._measure import measure_model, name_of
        from memsave_cli.pytest_plugin._settings import Settings

        with _reported():
            run = measure_model(model, impl, Settings.of(settings))
        if not run.ok:
            pytest.fail(f"memsave: {name_of(model)} could not be measured: {run.error}", False)
        return run

    @_notes_once
    def assert_fits(
        self,
        model: ModelLike,
        budget: str | int,
        *,
        impl: str = "memsave",
        metric: str = "peak",
        **settings: Any,
    ) -> Run:
        """Fail the test unless a training step of ``model`` needs at most ``budget`` bytes.

        ``budget`` is a size such as ``"1.5GiB"`` or ``"500MB"`` (or bytes); ``metric`` is
        ``peak`` (through backward) or ``forward_peak`` (the paper's metric).
        """
        __tracebackhide__ = True
        from memsave_cli.pytest_plugin._measure import name_of
        from memsave_cli.pytest_plugin._messages import fits_message, metric_of
        from memsave_cli.pytest_plugin._settings import Settings

        with _reported():
            limit = read_size(budget)
            attribute, _ = metric_of(metric)
            chosen = Settings.of(settings)
        run = self.measure(model, impl=impl, **settings)
        if getattr(run, attribute) > limit:
            message = fits_message(name_of(model), run, metric, limit, chosen.describe(impl))
            raise AssertionError(message)
        return run

    @_notes_once
    def assert_saves(
        self,
        model: ModelLike,
        at_least: float,
        *,
        impl: str = "memsave",
        metric: str = "peak",
        **settings: Any,
    ) -> tuple[Run, Run]:
        """Fail the test unless ``impl`` layers cut the ``metric`` of ``model`` by ``at_least``
        (a fraction: 0.2 means at least 20% less than stock PyTorch)."""
        __tracebackhide__ = True
        fraction = isinstance(at_least, numbers.Real) and not isinstance(at_least, bool)
        if not (fraction and 0 <= at_least < 1):
            message = f"memsave: at_least is a fraction below 1, e.g. 0.2; got {at_least!r}"
            pytest.fail(message, False)
        from memsave_cli.pytest_plugin._measure import name_of
        from memsave_cli.pytest_plugin._messages import metric_of, saves_message
        from memsave_cli.pytest_plugin._settings import Settings

        with _reported():
            attribute, _ = metric_of(metric)
            chosen = Settings.of(settings)
        stock = self.measure(model, impl="stock", **settings)
        memsave = self.measure(model, impl=impl, **settings)
        before, after = getattr(stock, attribute), getattr(memsave, attribute)
        # exactly, against the fraction as written (a saving of 10% meets at_least=0.1)
        if Fraction(before - after, before) < Fraction(str(float(at_least))):
            name = name_of(model)
            raise AssertionError(
                saves_message(name, stock, memsave, metric, at_least, chosen, impl)
            )
        return stock, memsave


@contextlib.contextmanager
def _reported() -> Iterator[None]:
    """A MemsaveError (a bad spec, budget or case) fails the test with its one line, as the
    CLI reports it, instead of a traceback into memsave."""
    __tracebackhide__ = True
    try:
        yield
    except MemsaveError as error:
        raise pytest.fail.Exception(f"memsave: {error}", pytrace=False) from None


@pytest.fixture
def memsave() -> MemsaveFixture:
    """Memory budgets of a training step: ``memsave.assert_fits(model, budget="1.5GiB")``."""
    return MemsaveFixture()


# -- the marker ----------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Declare the marker, so that ``--strict-markers`` suites may use it."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(model, budget=None, at_least=None, impl='memsave', metric='peak', "
        "**settings): fail the test unless a training step of model fits budget and/or memsave "
        "saves at_least of it; settings are memsave profile's options (case=, batch_size=, ...)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Check every ``memsave_budget`` marker of ``item`` before its body runs; each distinct
    note once, at the test's line."""
    marks = list(item.iter_markers(name=MARKER))
    if not marks:
        return
    line = item.location[1]  # None for an item that names no line (a custom item, a doctest)
    with _notes_after(at=(str(item.path), 0 if line is None else line + 1)):
        for mark in marks:
            check_marker(mark.args, dict(mark.kwargs))


def check_marker(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``@pytest.mark.memsave_budget(model, budget=..., at_least=..., **settings)``: the failure
    of ``assert_fits`` or ``assert_saves``, reported without a traceback into the plugin."""
    __tracebackhide__ = True
    if len(args) + ("model" in kwargs) != 1:
        pytest.fail(
            f"memsave: @pytest.mark.{MARKER} takes one model, e.g. 'torchvision:resnet18'", False
        )
    model = args[0] if args else kwargs.pop("model")
    budget, at_least = kwargs.pop("budget", None), kwargs.pop("at_least", None)
    if budget is None and at_least is None:
        pytest.fail(
            f"memsave: @pytest.mark.{MARKER} needs budget= (e.g. '1.5GiB') or at_least=", False
        )
    fixture = MemsaveFixture()
    try:
        if budget is not None:
            fixture.assert_fits(model, budget, **kwargs)
        if at_least is not None:
            fixture.assert_saves(model, at_least, **kwargs)
    except AssertionError as failure:
        raise pytest.fail.Exception(f"{MARKER}: {failure}", pytrace=False) from None

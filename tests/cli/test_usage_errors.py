"""A command line Click cannot parse is one line and exit 2, like every other bad input."""

from __future__ import annotations

import pytest
from test_preflight import one_error_line

from memsave_cli.cli import app


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["profile", "torchvision:resnet18", "--bogus"], "No such option: --bogus"),
        (["profile"], "Missing argument 'MODEL'."),
        (["profile", "x", "--batch-size", "abc"], "Invalid value for '--batch-size'"),
        (["profile", "x", "--dtype", "float64"], "'float64' is not one of 'float32'"),
        (["fit", "x", "--budget"], "Option '--budget' requires an argument."),
        (["bogus"], "No such command 'bogus'."),
        (["check"], "Missing argument 'REPORT'."),
        # Beyond these, sizes and deadlines overflow 64-bit integers after work has started.
        (["profile", "x", "--timeout", "1e10"], "Invalid value for '--timeout'"),
        (["fit", "x", "--budget", "1GiB", "--timeout", "1e10"], "Invalid value for '--timeout'"),
        (["profile", "x", "--batch-size", str(2**64)], "Invalid value for '--batch-size'"),
        (["probe", "linear", "--batch-size", str(2**40)], "Invalid value for '--batch-size'"),
    ],
)
def test_unparsable_command_lines_are_one_line(runner, args, expected):
    line = one_error_line(runner.invoke(app, args))
    assert expected in line


def test_where_the_options_are_listed(runner):
    line = one_error_line(runner.invoke(app, ["profile", "x", "--bogus"]))
    assert line.endswith("(memsave profile -h lists the options)")
    line = one_error_line(runner.invoke(app, ["bogus"]))
    assert line.endswith("(memsave -h lists the commands and options)")


def test_help_still_answers(runner):
    assert runner.invoke(app, ["profile", "-h"]).exit_code == 0
    bare = runner.invoke(app, [])
    assert bare.exit_code == 2 and "Usage" in bare.output and "error:" not in bare.output


@pytest.mark.parametrize(
    ("args", "first", "second"),
    [
        (["profile", "torchvision:resnet18", "--json", "{p}", "--csv", "{p}"], "--json", "--csv"),
        (["probe", "linear", "--json", "{p}", "--plot", "{p}"], "--json", "--plot"),
    ],
)
def test_two_outputs_to_one_file_are_refused(runner, tmp_path, args, first, second):
    """The second file would overwrite the first after every measurement."""
    path = str(tmp_path / "out.json")
    line = one_error_line(runner.invoke(app, [a.format(p=path) for a in args]))
    assert line == f"error: {first} and {second} both name {path}; give each its own file"


def test_option_names_do_not_depend_on_the_typer_version():
    """Typer before 0.29 named an option whose metavar spells its parameter in capitals after
    the metavar (``--CASE``), so ``--case`` was refused on the GPU machines: the names are
    given explicitly."""
    import typer

    command = typer.main.get_command(app)
    for name in ("profile", "fit"):
        options = {o for p in command.commands[name].params for o in getattr(p, "opts", ())}
        assert {"--case", "--impl"} <= options, sorted(options)


def test_help_for_no_command_exits_2_on_every_click(monkeypatch):
    """Click before 8.2 (under typer before 0.16) prints the help of a bare ``memsave`` and
    returns 0, where later ones raise: both end in exit 2."""
    from typer.core import TyperGroup

    from memsave_cli.cli._errors import OneLineUsageErrors

    monkeypatch.setattr(TyperGroup, "main", lambda self, *args, **kwargs: 0)
    with pytest.raises(SystemExit) as exited:
        OneLineUsageErrors(name="memsave").main([])
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        OneLineUsageErrors(name="memsave").main(["layers"])
    assert exited.value.code == 0

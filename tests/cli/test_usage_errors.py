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

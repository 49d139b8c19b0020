"""Real CLI output for the docs: every command's ``--help``, and worked examples.

Each call's output lands verbatim in ``docs/generated/cli-*.md`` as a console block headed by the
command, so the CLI reference and the quick start never drift from what the tool prints.

    python -m benchmarks.reproduce.cli_pages [--no-examples]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.reproduce.record import GENERATED, RESULTS, ROOT, environment, relative, save
from memsave_cli.report import write_atomic

COMMANDS = ("profile", "check", "fit", "probe", "layers")
WIDTH = "100"

#: Worked examples: include name -> the command a user types (run on meta, no GPU needed).
EXAMPLES = {
    "example-profile": "memsave profile torchvision:resnet101 --case surgical --device meta",
    "example-profile-hf": "memsave profile hf:configs/t5-base --case input --device meta",
    "example-fit": "memsave fit torchvision:resnet50 --budget 8GiB --case input --case all",
}


def console(command: str) -> tuple[str, float]:
    """Run a ``memsave ...`` command line; return its output (stdout and stderr) and seconds."""
    args = shlex.split(command)
    env = {**os.environ, "COLUMNS": WIDTH, "NO_COLOR": "1", "TERM": "dumb"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "memsave_cli", *args[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    output = "\n".join(line.rstrip() for line in (done.stdout + done.stderr).splitlines())
    if done.returncode not in (0, 1):
        output += f"\n(exit code {done.returncode})"
    return output, time.perf_counter() - start


def block(command: str, output: str) -> str:
    """A console code block: the prompt line, then the output."""
    fence = "````" if "```" in output else "```"
    return f"{fence}console\n$ {command}\n{output}\n{fence}\n"


def write(name: str, command: str) -> float:
    output, seconds = console(command)
    write_atomic(GENERATED / f"{name}.md", block(command, output))
    print(f"{name}: {seconds:.1f} s")
    return seconds


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-examples", action="store_true", help="only the --help pages")
    args = parser.parse_args(argv)
    made = {"cli-help": write("cli-help", "memsave --help")}
    for command in COMMANDS:
        made[f"cli-help-{command}"] = write(f"cli-help-{command}", f"memsave {command} --help")
    if not args.no_examples:
        for name, command in EXAMPLES.items():
            made[name] = write(name, command)
    index = {
        "kind": "cli",
        "command": "python -m benchmarks.reproduce.cli_pages",
        "environment": environment(),
        "outputs": {name: round(seconds, 1) for name, seconds in made.items()},
    }
    save(RESULTS / "cli.json", index)
    print(f"index -> {relative(RESULTS / 'cli.json')}")


if __name__ == "__main__":
    main()

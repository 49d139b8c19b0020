"""Reproduce the paper's tables and figures with memsave's own API and CLI.

Every script writes its raw results under ``docs/results/`` together with the command that
produced them; ``benchmarks.reproduce.tables`` turns those files into the markdown tables the
documentation includes, so no number in the docs is typed by hand. One command regenerates all:

    python -m benchmarks.reproduce.all
"""

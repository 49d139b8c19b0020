"""``python -m memsave_cli``: the same as the ``memsave`` command."""

from memsave_cli.cli import main

if __name__ == "__main__":
    main()

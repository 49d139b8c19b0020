"""The warning the plugin turns ``memsave profile``'s notes into (importing no torch: the
plugin's module exports it, and pytest imports that module in every session)."""

from __future__ import annotations


class MemsaveNote(UserWarning):
    """A note ``memsave profile`` prints under its numbers: on the meta device those of the plan
    check (parts of the model that the inputs do not run, and so are not in the numbers: NOTE
    [idle parts]); a spec measured in a worker (cpu, cuda) gives every note of its report."""

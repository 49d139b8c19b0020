"""Parts of a model that the inputs memsave made do not run, so that no number hides them.

NOTE [idle parts]: memsave feeds a Hugging Face model what its forward takes alone (token ids,
pixels or audio). A vision-language model (LLaVA, Qwen2-VL, PaliGemma) takes token ids alone
too, and then runs its language model only: the vision tower holds a few percent of the weights
and, in training with images, a large share of the activations, none of which such a run counts.
The plan check's one meta forward records which modules are called; a subtree none of whose
modules is called and which holds at least ``SHARE`` of the parameters is named in the report,
with what would run it (a companion giving the inputs). A parameter shared with a called module
(tied embeddings) counts as used. A module whose weights are used without calling it
(``F.linear(x, self.proj.weight)``) would be named wrongly, so the share keeps small helpers out
and the note says "not called", which is what was observed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

#: The least share of the model's parameters an idle part must hold to be named.
SHARE = 0.01


@contextlib.contextmanager
def calls_recorded(called: set[int]) -> Iterator[None]:
    """Add to ``called`` the id of every module called while active (any model)."""

    def record(module: nn.Module, args: object) -> None:
        called.add(id(module))

    handle = nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield
    finally:
        handle.remove()


def idle_parts(model: nn.Module, called: set[int]) -> list[tuple[str, int]]:
    """``(name, parameter count)`` of the largest subtrees of ``model`` that no call reached,
    each holding at least ``SHARE`` of its parameters; none where the model itself was not
    called (the forward failed before it). A parameter shared with a called module (tied
    embeddings, T5's ``shared``) counts as used."""
    if id(model) not in called:
        return []
    total = sum(p.numel() for p in model.parameters())
    reached = _reached(model, called)
    used = {
        id(p)
        for module in model.modules()
        if id(module) in called
        for p in module.parameters(recurse=False)
    }
    parts = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if id(child) in reached:
                visit(child, f"{path}.")
                continue
            count = sum(p.numel() for p in child.parameters() if id(p) not in used)
            if total and count >= SHARE * total:
                parts.append((path, count))

    visit(model, "")
    return sorted(parts, key=lambda part: -part[1])


def _reached(model: nn.Module, called: set[int]) -> set[int]:
    """Ids of the modules called or holding a called module."""
    reached: set[int] = set()

    def walk(module: nn.Module) -> bool:
        hit = id(module) in called
        for child in module.children():
            hit = walk(child) or hit  # every child walked
        if hit:
            reached.add(id(module))
        return hit

    walk(model)
    return reached


def idle_note(text: str, model: nn.Module, parts: list[tuple[str, int]]) -> list[str]:
    """The report's note naming ``parts`` (NOTE [idle parts]); none where there are none."""
    if not parts:
        return []
    total = sum(p.numel() for p in model.parameters())
    named = ", ".join(f"{name} ({count / total:.0%} of the parameters)" for name, count in parts)
    it, keeps = ("they", "keep") if len(parts) > 1 else ("it", "keeps")
    return [
        f"the inputs made for {text} do not call {named}: what {it} {keeps} in training is not "
        f"in these numbers; to count it, build the model in a callable spec whose "
        f"<callable>_inputs(batch_size) companion feeds {'them' if len(parts) > 1 else 'it'}"
    ]

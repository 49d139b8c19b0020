"""Activation checkpointing of chosen modules: what is selected, that a checkpointed step trains
as the plain one does, bit for bit, and what it keeps, measured on meta as on cpu."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from fixtures_tracker import blocks_cnn
from torch import nn

from memsave_cli import meta_dropout
from memsave_cli.cases import resolve_case
from memsave_cli.checkpointing import (
    checkpoint_notes,
    checkpoint_targets,
    enable_checkpointing,
    read_patterns,
)
from memsave_cli.errors import MemsaveError
from memsave_cli.layers.convert import convert
from memsave_cli.measure import Job, measure
from memsave_cli.specs import parse_spec

BLOCKS = "fixtures_tracker:blocks_cnn"


@pytest.fixture(autouse=True)
def fused_dropout_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stock dropout keeps CUDA's 1-byte mask on cpu too, as on meta (``test_meta_vs_cpu.py``)."""
    monkeypatch.setattr(meta_dropout, "DEVICES", ("meta", "cpu"))


def _names(model: nn.Module, *patterns: str) -> list[str]:
    return [name for name, _ in checkpoint_targets(model, patterns)]


def test_targets_are_the_outermost_matches_in_order() -> None:
    model = blocks_cnn()
    assert _names(model, "blocks.?") == ["blocks.0", "blocks.1"]
    # ``blocks*`` also matches the blocks' layers and ``blocks`` itself: only the outermost stays.
    assert _names(model, "blocks*") == ["blocks"]
    block = ["blocks.1.0", "blocks.1.1", "blocks.1.2", "blocks.1.3"]
    assert _names(model, "head", "blocks.1.*") == [*block, "head"]


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        (("zzz*",), "checkpoint pattern 'zzz*' selects no module; names look like stem, "),
        (("blocks.?", "nope"), "checkpoint pattern 'nope' selects no module"),
        (("auto",), "checkpoint 'auto' selects nothing: Sequential has no Hugging Face decoder"),
    ],
)
def test_a_pattern_selecting_nothing_raises(patterns: tuple[str, ...], message: str) -> None:
    with pytest.raises(MemsaveError) as error:
        checkpoint_notes(blocks_cnn(), patterns)
    assert message in str(error.value)


@pytest.mark.parametrize("given", [[None], [""], ["  "], [3], ["blocks.?", 2.5]])
def test_patterns_must_be_strings(given: list) -> None:
    with pytest.raises(MemsaveError, match="module-name globs or 'auto'"):
        read_patterns(given)


def test_patterns_as_callers_pass_them() -> None:
    assert read_patterns(None) == ()
    assert read_patterns("auto") == ("auto",)
    assert read_patterns(["blocks.?", "head", "blocks.?"]) == ("blocks.?", "head")
    note = checkpoint_notes(blocks_cnn(), ("blocks.?",))
    assert note == [
        "activation checkpointing: 2 modules recompute their forward in backward "
        "(blocks.0, blocks.1)"
    ]


def _step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient of one step (dropout drawn anew)."""
    torch.manual_seed(3)
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    out.square().sum().backward()
    return [out.detach(), leaf.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("trained", ["all", "input"])
@pytest.mark.parametrize("impl", ["stock", "memsave"])
def test_a_checkpointed_step_is_the_plain_one_bit_for_bit(trained: str, impl: str) -> None:
    """Recomputed blocks (convolutions, BatchNorm in training, in-place ReLU, dropout) give the
    plain step's output and gradients, with stock layers and with memsave's: the recomputation
    draws the dropout noise of the first forward (memsave's dropout draws its own, so each is
    compared with its own plain step)."""
    torch.manual_seed(0)
    model = blocks_cnn().train()
    if trained == "input":
        model.requires_grad_(False)
    if impl == "memsave":
        model = convert(model)
    x = torch.randn(2, 3, 12, 12)
    expected = _step(copy.deepcopy(model), x)
    assert enable_checkpointing(model, ("blocks.?", "stem")) == 3
    for want, got in zip(expected, _step(model, x), strict=True):
        assert (want is None and got is None) or torch.equal(want, got)


def _run(device: str, impl: str, checkpoint: tuple[str, ...], case: str = "all"):
    job = Job(
        parse_spec(BLOCKS),
        resolve_case(case),
        impl,
        device,
        batch_size=4,
        repeat=0,
        checkpoint=checkpoint,
    )
    run = measure(job)
    assert run.ok, run.error
    return run


@pytest.mark.parametrize("case", ["all", "input"])
def test_measured_on_meta_as_on_cpu_and_memsave_still_saves(case: str) -> None:
    """Checkpointing lowers stock's forward peak; memsave keeps less than stock in each step of
    it; meta's estimate is cpu's accounting to the byte."""
    runs = {
        (device, impl, bool(patterns)): _run(device, impl, patterns, case)
        for device in ("meta", "cpu")
        for impl in ("stock", "memsave")
        for patterns in ((), ("blocks.?",))
    }
    for impl in ("stock", "memsave"):
        for checkpointed in (False, True):
            meta, cpu = runs["meta", impl, checkpointed], runs["cpu", impl, checkpointed]
            assert (meta.forward_peak_bytes, meta.peak_bytes, meta.saved_bytes) == (
                cpu.forward_peak_bytes,
                cpu.peak_bytes,
                cpu.saved_bytes,
            )
    plain, checkpointed = runs["meta", "stock", False], runs["meta", "stock", True]
    assert checkpointed.forward_peak_bytes < plain.forward_peak_bytes
    assert checkpointed.saved_bytes < plain.saved_bytes
    memsave = runs["meta", "memsave", True]
    assert memsave.peak_bytes < checkpointed.peak_bytes
    assert memsave.saved_bytes < checkpointed.saved_bytes


def test_auto_selects_the_decoder_layers(tiny_llama_dir: Path) -> None:
    from memsave_cli.specs import build_model

    model = build_model(parse_spec(f"hf:{tiny_llama_dir}"))
    assert _names(model, "auto") == ["model.layers.0", "model.layers.1"]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_auto_flags_the_modules_gradient_checkpointing_enable_flags(attention: str) -> None:
    """GPT-2's model hands its layers the key/value cache positionally and drops it by its own
    flag: with only the layers flagged, eager attention recomputed over twice the keys and
    failed, and sdpa counted the cache."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32, use_cache=True,
        attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    theirs = copy.deepcopy(model)
    theirs.gradient_checkpointing_enable()
    assert enable_checkpointing(model, ("auto",)) == 2
    flagged = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", 0)]
    assert flagged == [
        n for n, m in theirs.named_modules() if getattr(m, "gradient_checkpointing", 0)
    ]
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    assert output.past_key_values is None


@pytest.mark.slow
def test_auto_trains_a_lora_llama_as_without_checkpointing(tiny_llama_dir: Path) -> None:
    """transformers' own switch: bit for bit the plain step's loss and adapter gradients, stock
    and converted, and the layers write no key/value cache a second time in backward."""
    pytest.importorskip("peft")
    import transformers

    from memsave_cli.lora import apply_lora, lora_settings

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    stock = apply_lora(base, lora_settings(rank=4, dropout=0.1)).train()
    ids = torch.randint(0, 300, (2, 9))

    def step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        output = model(input_ids=ids, labels=ids)
        output.loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        cache = output.past_key_values  # none at all where every owner of the flag has it
        return output.loss.detach(), grads, 0 if cache is None else cache.get_seq_length()

    loss, grads, cached = step(copy.deepcopy(stock))
    assert cached == 9
    for model in (copy.deepcopy(stock), convert(copy.deepcopy(stock))):
        assert enable_checkpointing(model, ("auto",)) == 2
        loss_c, grads_c, cached_c = step(model)
        assert torch.equal(loss, loss_c)
        assert len(grads) == len(grads_c) and all(map(torch.equal, grads, grads_c))
        assert cached_c == 0  # the checkpointed layers left the cache alone
    # transformers' notice that they did is what was asked for: filtered, nothing else.
    logger = logging.getLogger("transformers.modeling_layers")
    notice = "Caching is incompatible with gradient checkpointing in LlamaDecoderLayer. Setting"
    for message, shown in ((notice, False), ("anything else", True)):
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, (), None)
        assert bool(logger.filter(record)) is shown  # Python 3.12 returns the record


@pytest.mark.slow
def test_a_lora_case_with_auto_is_measured_on_meta_as_on_cpu(tiny_llama_dir: Path) -> None:
    spec, case = parse_spec(f"hf:{tiny_llama_dir}"), resolve_case("lora")
    settings = {"batch_size": 2, "input_shape": (16,), "attention": "math", "repeat": 0}
    runs = {}
    for device in ("meta", "cpu"):
        for impl in ("stock", "memsave"):
            job = Job(spec, case, impl, device, checkpoint=("auto",), **settings)
            runs[device, impl] = run = measure(job)
            assert run.ok, run.error
    for impl in ("stock", "memsave"):
        meta, cpu = runs["meta", impl], runs["cpu", impl]
        assert meta.forward_peak_bytes == cpu.forward_peak_bytes
    stock, memsave = runs["meta", "stock"], runs["meta", "memsave"]
    assert stock.peak_bytes == runs["cpu", "stock"].peak_bytes
    # On the CPU each replayed adapter keeps the generator's 5056-byte state in CPU memory
    # (5120 bytes as counted); a GPU's is 16 bytes on the host, which meta does not count.
    states = runs["cpu", "memsave"].peak_bytes - memsave.peak_bytes
    assert 0 < states <= 14 * 5120  # 7 adapters in each of 2 layers
    assert memsave.peak_bytes < stock.peak_bytes

"""Every language model family this transformers ships, converted, against stock.

Run: ``python -m benchmarks.family_sweep [--kind causal|masked|seq2seq] [--families llama,gpt2]
[--jobs 2] [--out sweep.json]``. ``--kind`` picks the model classes: causal language models
(``AutoModelForCausalLM``, the default), masked ones (``AutoModelForMaskedLM``: BERT and its kin)
or encoder-decoders (``AutoModelForSeq2SeqLM``: T5, BART, ...).
Each family's default configuration is cut to a small model (two layers, hidden 32, vocabulary
128, four experts where it has experts; layer-type lists cut to one layer of each type) with
dropout set to 0, no cache and eager attention, built in float32 with the kind's ``from_config``,
and trained one step on the same token ids, stock and ``convert``-ed, twice: every weight
trainable, and weights frozen with the input embeddings differentiated (the paper's fine-tuning
case). Loss and every gradient must be bitwise equal. Each family runs in a process of its own
(a timeout or a crash is that family's result). A family whose small model cannot be built, or
that stock itself cannot train either way on these inputs, is reported, not counted.

The result per family: ``ok`` with the classes ``convert`` swapped and the look-alikes it left
stock (``unrecognised_counts``), ``differs`` (which gradient), ``fails`` (which error, with
memsave only), ``not built`` or ``not trained``. Models nobody tuned the drop-ins to must convert
correctly or be left alone; this is the check of that over a library's whole zoo.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

#: Configuration keys of a model's size, and the small values they are cut to.
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_embd": 32,
    "d_model": 32,
    "ffn_dim": 64,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "n_positions": 128,
    "embedding_size": 32,
    "embedding_dim": 32,  # xLSTM's, NeoMME's width
    # Multi-head latent attention (DeepSeek-V2 and its kin): the rotary part is ``head_dim``.
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 8,
    "rotary_dim": 4,  # GPT-J, CodeGen: within a head of 32 / 4
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,  # expert groups, of the four experts
    "topk_group": 1,
    # Mamba-2 mixers (Bamba, Granite hybrid, Zamba2): heads x head size = expand x hidden = 64.
    "mamba_n_heads": 8,
    "mamba_d_head": 8,
    "mamba_headdim": 8,
    "mamba_d_ssm": 64,  # Falcon-H1's heads x head size, where it names it
    "mamba_d_state": 16,
    "mamba_dt_rank": 2,
    # Zamba's shared attention over the concatenated input and embedding (2 x hidden).
    "attention_hidden_size": 64,
    "attention_head_dim": 16,
}
#: Settings some default configurations leave unset (None), which their models need for a
#: step: DeepSeek-V2's experts per token.
_UNSET = {"num_experts_per_tok": 2}
#: Mamba-2's own names for its mixer's heads (``num_heads`` means attention heads elsewhere),
#: cut where a configuration has its ``n_groups`` and ``expand``.
_MAMBA2 = {"num_heads": 8, "head_dim": 8, "n_groups": 1}
#: Words in the names of settings that draw random numbers in training (dropout, layer drop,
#: router jitter): set to 0, so that a step is deterministic.
_RANDOM_IN_TRAINING = ("dropout", "pdrop", "layerdrop", "jitter")
#: Endings of the names of nested configurations (``text_config``; T5Gemma's ``encoder``).
_NESTED = ("_config", "encoder", "decoder")
#: Configuration keys of a model's depth.
LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers")
_TIMEOUT_S = 300


#: Kinds of model: the name of transformers' table of their model types, and their auto class.
KINDS = {
    "causal": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
}


def families(kind: str = "causal") -> list[str]:
    """Every model type with a model class of ``kind`` in this transformers."""
    from transformers.models.auto import modeling_auto

    return sorted(getattr(modeling_auto, KINDS[kind][0]))


def small_config(family: str) -> Any:
    """``family``'s default configuration cut to a small model (module docstring)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    _cut(config)
    config._attn_implementation = "eager"
    if getattr(config, "decoder_start_token_id", None) is None:
        # Encoder-decoders shift their labels right from it (T5's configuration names none).
        config.decoder_start_token_id = config.to_dict().get("pad_token_id") or 0
    return config


def _cut(config: Any) -> None:
    settings = config.to_dict()
    for key, value in _UNSET.items():
        if key in settings and settings[key] is None:
            setattr(config, key, value)
    mamba2 = "n_groups" in settings and "expand" in settings
    for key, value in (SMALL | _MAMBA2 if mamba2 else SMALL).items():
        if isinstance(settings.get(key), int) and not isinstance(settings[key], bool):
            setattr(config, key, value)
    if isinstance(settings.get("kv_lora_rank"), int) and isinstance(
        settings.get("num_key_value_heads"), int
    ):
        # Latent attention makes a key per query head; the eager kernel would repeat them.
        config.num_key_value_heads = SMALL["num_attention_heads"]
    types = settings.get("layer_types")
    depth = 2
    if isinstance(types, list) and types:
        kept = list(dict.fromkeys(types))  # one layer of each type, in order of appearance
        config.layer_types = kept + types[: max(0, 2 - len(kept))]
        depth = len(config.layer_types)
    for key in LAYERS:
        if isinstance(settings.get(key), int):
            setattr(config, key, depth)
    for key, value in settings.items():
        if isinstance(value, float) and any(word in key for word in _RANDOM_IN_TRAINING):
            setattr(config, key, 0.0)
    if "use_cache" in settings:
        # A training step needs no cache, and one of recurrent layers alone (a hybrid cut to
        # two layers) refuses the sequence length transformers asks it for.
        config.use_cache = False
    for key in settings:  # nested configurations: text_config, encoder_config, encoder, ...
        nested = getattr(config, key, None) if key.endswith(_NESTED) else None
        if nested is not None and hasattr(nested, "to_dict"):
            _cut(nested)


def _step(model: nn.Module, ids: Tensor, frozen: bool) -> tuple[Tensor, list]:
    """Loss and gradients of one step: every parameter's, or the input embeddings' alone, from
    the same random state for stock and converted (randomness left in a model draws alike)."""
    torch.manual_seed(2)
    for p in model.parameters():
        p.requires_grad_(not frozen)
        p.grad = None
    if frozen:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        loss = model(inputs_embeds=embeds, labels=ids).loss
        loss.backward()
        return loss.detach(), [embeds.grad]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def check_family(family: str, kind: str = "causal") -> dict[str, Any]:
    """The sweep's result for one family, in this process."""
    import transformers

    from memsave_cli.layers import convert, converted_counts
    from memsave_cli.layers.recognise import unrecognised_counts

    auto = getattr(transformers, KINDS[kind][1])
    try:
        torch.manual_seed(0)
        stock = auto.from_config(small_config(family)).float().train()
    except Exception as error:  # the cut configuration is not one the family accepts
        return {"family": family, "result": "not built", "detail": _line(error)}
    converted = convert(stock)
    result = {
        "family": family,
        "converted": converted_counts(converted),
        "left stock": unrecognised_counts(converted),
    }
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    compared, refused = [], []
    for frozen in (False, True):
        pattern = "weights frozen" if frozen else "all trainable"
        try:
            ref = _step(stock, ids, frozen)
        except Exception as error:  # stock itself cannot train this way: nothing to compare
            refused.append(f"{pattern}: {_line(error)}")
            continue
        compared.append(pattern)
        try:
            mine = _step(converted, ids, frozen)
        except Exception as error:
            return {**result, "result": "fails", "detail": f"{pattern}: {_line(error)}"}
        grads = [i for i, (a, b) in enumerate(zip(ref[1], mine[1], strict=True)) if not _same(a, b)]
        if not torch.equal(ref[0], mine[0]) or grads:
            detail = f"{pattern}: loss {'equal' if torch.equal(ref[0], mine[0]) else 'differs'}"
            return {**result, "result": "differs", "detail": f"{detail}, gradients {grads[:5]}"}
    if not compared:
        return {**result, "result": "not trained", "detail": refused[0]}
    return {**result, "result": "ok", "compared": compared}


def _line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def _in_worker(family: str, kind: str) -> dict[str, Any]:
    """``check_family`` in a process of its own."""
    command = [sys.executable, "-m", "benchmarks.family_sweep", "--kind", kind, "--worker", family]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"family": family, "result": "fails", "detail": f"no result in {_TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"family": family, "result": "fails", "detail": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, default="causal", help="which model classes")
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="families checked at once")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(check_family(args.worker, args.kind)))
        return 0
    names = args.families.split(",") if args.families else families(args.kind)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = []
        for result in pool.map(lambda name: _in_worker(name, args.kind), names):
            results.append(result)
            swapped = ", ".join(f"{k} {v}" for k, v in result.get("converted", {}).items())
            print(f"{result['family']:28} {result['result']:10} {result.get('detail', swapped)}")
    counts = Counter(result["result"] for result in results)
    print("; ".join(f"{n} {k}" for k, n in counts.items()))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
    return 1 if counts.get("differs") or counts.get("fails") else 0


if __name__ == "__main__":
    raise SystemExit(main())

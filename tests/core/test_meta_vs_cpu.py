"""A second opinion on the meta estimate: a real CPU step of the same model saves the same tensors.

Totals can agree by luck; here every saved storage is compared, per layer, by shape, dtype and
bytes, and then the forward and step peaks of the tracker on both devices. Attention runs the same kernel on both sides (``math``): on meta ``auto`` counts the CUDA
kernel, which a CPU does not have. Stock dropout runs CUDA's fused kernel on both sides (the CPU
has it too, though ``F.dropout`` does not pick it there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memsave_cli import meta_dropout
from memsave_cli.cases import resolve_case
from memsave_cli.measure import Job, measure
from memsave_cli.meta_as_cuda import counted_as_on_cuda
from memsave_cli.meta_attention import attention_kernels
from memsave_cli.saved import SavedTensorRecorder
from memsave_cli.specs import parse_spec
from memsave_cli.step import prepare, train_step

Saved = tuple[str, tuple[int, ...], torch.dtype, int]


@pytest.fixture(autouse=True)
def fused_dropout_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meta_dropout, "DEVICES", ("meta", "cpu"))


class _DetailRecorder(SavedTensorRecorder):
    """Also remembers each distinct saved storage's layer, shape and dtype, in saving order."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.details: list[Saved] = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        before = len(self.records)
        packed = super()._pack(tensor)
        if len(self.records) > before:
            record = self.records[-1]
            self.details.append((record.module, tuple(tensor.shape), tensor.dtype, record.nbytes))
        return packed


def saved_tensors(job: Job) -> list[Saved]:
    """Every distinct storage one training step of ``job`` saves for backward (parameters too)."""
    torch.manual_seed(0)
    prepared = prepare(job)
    with (
        attention_kernels(job.device, job.attention),
        counted_as_on_cuda(job.device),
        _DetailRecorder(prepared.model) as recorder,
    ):
        train_step(prepared)
    # Empty storages hold nothing: cuDNN's batch norm keeps an empty reserve the CPU's lacks.
    return [saved for saved in recorder.details if saved[3] > 0]


def assert_same_saved(spec: str, case: str, **settings: object) -> list[Saved]:
    """Meta and cpu save the same tensors, layer by layer; a difference names the first one."""
    jobs = {
        device: Job(parse_spec(spec), resolve_case(case), "stock", device, repeat=0, **settings)
        for device in ("meta", "cpu")
    }
    meta, cpu = saved_tensors(jobs["meta"]), saved_tensors(jobs["cpu"])
    for position, (estimated, real) in enumerate(zip(meta, cpu, strict=False)):
        assert estimated == real, f"saved tensor {position}: meta {estimated} != cpu {real}"
    assert len(meta) == len(cpu), f"meta saves {len(meta)} tensors, cpu {len(cpu)}"
    return meta


def assert_same_peaks(spec: str, case: str, **settings: object) -> None:
    """Meta and cpu reach the same forward and step peaks (temporaries of kernels included)."""
    runs = {
        device: measure(
            Job(parse_spec(spec), resolve_case(case), "stock", device, repeat=0, **settings)
        )
        for device in ("meta", "cpu")
    }
    assert runs["meta"].ok and runs["cpu"].ok, (runs["meta"].error, runs["cpu"].error)
    assert runs["meta"].forward_peak_bytes == runs["cpu"].forward_peak_bytes
    assert runs["meta"].peak_bytes == runs["cpu"].peak_bytes


@pytest.mark.parametrize("bn_eval", [False, True], ids=["bn-train", "bn-eval"])
@pytest.mark.parametrize("case", ["all", "input", "surgical"])
def test_cnn(case: str, bn_eval: bool) -> None:
    """Batch norm in eval mode keeps no statistics on the CPU, as cuDNN's kernel (NOTE [batch
    norm on meta]); in training both keep one float per channel for mean and deviation."""
    settings = {"batch_size": 2, "input_shape": (3, 32, 32), "dtype": "float32", "bn_eval": bn_eval}
    saved = assert_same_saved("torchvision:resnet18", case, **settings)
    assert any(layer.startswith("layer1") for layer, *_ in saved)
    assert_same_peaks("torchvision:resnet18", case, **settings)


@pytest.mark.parametrize("case", ["all", "input", "norm"])
def test_transformer_with_dropout(case: str) -> None:
    saved = assert_same_saved(
        "fixtures_tracker:small_transformer", case, batch_size=3, attention="math"
    )
    # the math path keeps the (B, H, L, S) attention weights and their dropout noise
    assert sum(shape == (3, 4, 12, 12) for _, shape, *_ in saved) >= 2
    # nn.Dropout keeps CUDA's 1-byte mask
    assert any("dropout" in layer and dtype == torch.bool for layer, _, dtype, _ in saved)
    assert_same_peaks("fixtures_tracker:small_transformer", case, batch_size=3, attention="math")


@pytest.mark.parametrize(
    ("case", "inputs"), [("all", "auto"), ("input", "auto"), ("norm", "embeds")]
)
def test_llama_style_model(tiny_llama_dir: Path, case: str, inputs: str) -> None:
    settings = {"batch_size": 2, "input_shape": (20,), "attention": "math", "inputs": inputs}
    saved = assert_same_saved(f"hf:{tiny_llama_dir}", case, **settings)
    assert_same_peaks(f"hf:{tiny_llama_dir}", case, **settings)
    if inputs == "auto" and case == "all":  # token ids and the model's own loss: float32 logits
        logits = [s for s in saved if s[1][-1:] == (300,) and s[3] >= 2 * 20 * 300 * 4]
        assert logits and all(dtype == torch.float32 for _, _, dtype, _ in logits)


def test_a_decoder_without_a_key_value_cache(tmp_path: Path) -> None:
    """``use_cache: false`` (common in fine-tuning configs, and what gradient checkpointing sets):
    transformers then asks whether the ``arange`` position ids restart anywhere, which meta
    answered only with "needs real data" (NOTE [known values on meta])."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path)  # fmt: skip
    settings = {"batch_size": 2, "input_shape": (20,), "attention": "math"}
    assert_same_saved(f"hf:{tmp_path}", "all", **settings)
    assert_same_peaks(f"hf:{tmp_path}", "all", **settings)


@pytest.fixture(scope="module")
def made_mask_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two-layer BART (encoder-decoder) and BioGPT configs: both fill an attention mask with
    ones themselves and read it back (NOTE [known values on meta])."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=300, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    configs = {
        "bart": transformers.BartConfig(
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            architectures=["BartForConditionalGeneration"],
            **small,
        ),
        "biogpt": transformers.BioGptConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            architectures=["BioGptForCausalLM"],
            vocab_size=300,
            max_position_embeddings=64,
        ),
    }
    dirs = {}
    for name, config in configs.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        config.save_pretrained(dirs[name])
    return dirs


@pytest.mark.parametrize("family", ["bart", "biogpt"])
@pytest.mark.parametrize("case", ["all", "input"])
def test_models_reading_their_own_mask(made_mask_dirs: dict, family: str, case: str) -> None:
    """Meta runs these (they needed real data before) and saves and peaks as a cpu step."""
    spec = f"hf:{made_mask_dirs[family]}"
    settings = {"batch_size": 2, "input_shape": (12,), "attention": "math"}
    assert_same_saved(spec, case, **settings)
    assert_same_peaks(spec, case, **settings)


@pytest.mark.parametrize("case", ["all", "input"])
def test_model_of_two_towers(tiny_clip_dir: Path, case: str) -> None:
    """CLIP fed token ids and pixels together, its contrastive loss included."""
    settings = {"batch_size": 3, "attention": "math"}
    assert_same_saved(f"hf:{tiny_clip_dir}", case, **settings)
    assert_same_peaks(f"hf:{tiny_clip_dir}", case, **settings)


@pytest.mark.parametrize("case", ["all", "input"])
def test_experts_of_grouped_products_in_float32(tmp_path: Path, case: str) -> None:
    """A mixture of experts whose experts run ``_grouped_mm`` (GraniteMoE), in float32, which
    PyTorch's meta kernel refuses and CUDA takes (NOTE [grouped_mm on meta])."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(
        "granitemoe",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        architectures=["GraniteMoeForCausalLM"],
    ).save_pretrained(tmp_path)
    settings = {"batch_size": 2, "input_shape": (12,), "attention": "math"}
    saved = assert_same_saved(f"hf:{tmp_path}", case, **settings)
    # the grouped product keeps its experts' weights (4 experts) for the tokens' gradient
    assert any(len(shape) == 3 and shape[0] == 4 for _, shape, _, _ in saved)

"""Example inputs by family (run on meta and on the CPU), and the loss taken of any model output."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from memsave_cli.errors import SpecError
from memsave_cli.inputs import Example, make_example
from memsave_cli.loss import loss_of
from memsave_cli.specs import ModelSpec, build_model, parse_spec

MODELS_FILE = Path(__file__).parent / "fixtures" / "tiny_models.py"

#: Detection kwargs that keep a CPU training step small: 64-pixel images, few proposals.
SMALL_DETECTION = [
    "min_size=64",
    "max_size=64",
    "rpn_pre_nms_top_n_train=32",
    "rpn_post_nms_top_n_train=16",
    "rpn_batch_size_per_image=16",
    "box_batch_size_per_image=16",
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Small CPU steps: threads only contend on a shared machine (OpenMP spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _example(
    text: str,
    device: str,
    kwargs: list[str] | None = None,
    batch_size: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    **extra: object,
) -> tuple[nn.Module, ModelSpec, Example]:
    spec = parse_spec(text, kwargs or [])
    with torch.device(device):
        model = build_model(spec)
    example = make_example(
        model,
        spec,
        batch_size=batch_size,
        input_shape=input_shape,
        dtype=dtype,
        device=device,
        **extra,
    )
    return model, spec, example


def _step(model: nn.Module, example: Example) -> tuple[object, torch.Tensor]:
    """Forward with differentiable inputs, loss, backward; every differentiable input gets a grad."""
    for tensor in example.differentiable:
        tensor.requires_grad_(True)
    output = model(*example.args, **example.kwargs)
    loss = loss_of(output)
    assert loss.shape == ()
    loss.backward()
    for tensor in example.differentiable:
        assert tensor.grad is not None and tensor.grad.shape == tensor.shape
    return output, loss


# -- torchvision families on meta, with the paper's sizes ----------------------------------------


@pytest.mark.filterwarnings("ignore:The default weight initialization:FutureWarning")
@pytest.mark.parametrize(
    ("name", "family", "shape"),
    [
        ("resnet18", "images", (64, 3, 224, 224)),
        ("inception_v3", "images", (64, 3, 299, 299)),
        ("r3d_18", "video", (64, 3, 16, 112, 112)),
        ("fcn_resnet50", "segmentation", (64, 3, 224, 224)),
    ],
)
def test_family_defaults_run_on_meta(name: str, family: str, shape: tuple[int, ...]) -> None:
    model, _, example = _example(f"torchvision:{name}", "meta")
    assert (example.family, example.batch_size, example.kwargs) == (family, 64, {})
    (x,) = example.args
    assert example.differentiable == (x,)
    assert (tuple(x.shape), x.device.type, x.dtype) == (shape, "meta", torch.float32)
    output, loss = _step(model, example)
    assert loss.device.type == "meta"
    if family == "segmentation":
        assert isinstance(output, OrderedDict) and set(output) == {"out"}


@pytest.mark.parametrize("name", ["mvit_v2_s", "s3d"])
def test_video_models_that_need_larger_frames(name: str) -> None:
    _, _, example = _example(f"torchvision:{name}", "meta")
    assert tuple(example.args[0].shape) == (64, 3, 16, 224, 224)


def test_optical_flow_gets_two_images_on_meta() -> None:
    model, _, example = _example("torchvision:raft_small", "meta", batch_size=2)
    first, second = example.args
    assert example.family == "flow"
    assert tuple(first.shape) == tuple(second.shape) == (2, 3, 224, 224)
    assert first is not second
    output, _ = _step(model, example)
    assert isinstance(output, list) and len(output) == 12  # one flow per refinement


def test_detection_defaults_on_meta() -> None:
    # torchvision's detection models call .item() while matching boxes, so they cannot run on meta;
    # their inputs can still be made there.
    _, _, example = _example("torchvision:maskrcnn_resnet50_fpn", "meta")
    images, targets = example.args
    assert (example.family, example.batch_size, len(images), len(targets)) == ("detection", 4, 4, 4)
    assert example.differentiable == tuple(images)
    assert {tuple(image.shape) for image in images} == {(3, 224, 224)}
    target = targets[0]
    assert set(target) == {"boxes", "labels", "masks"}
    assert tuple(target["boxes"].shape) == (2, 4) and target["boxes"].device.type == "meta"
    assert target["labels"].dtype == torch.int64
    assert (tuple(target["masks"].shape), target["masks"].dtype) == ((2, 224, 224), torch.uint8)


def test_detection_in_eval_mode_gets_no_targets() -> None:
    spec = parse_spec("torchvision:ssdlite320_mobilenet_v3_large")
    with torch.device("meta"):
        model = build_model(spec).eval()
    example = make_example(
        model, spec, batch_size=2, input_shape=None, dtype=torch.float32, device="meta"
    )
    assert len(example.args) == 1 and len(example.args[0]) == 2


# -- torchvision families on the CPU, small ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "shape"),
    [
        ("resnet18", [], (3, 32, 32)),
        ("r3d_18", [], (3, 2, 16, 16)),
        ("lraspp_mobilenet_v3_large", [], (3, 64, 64)),
        ("raft_small", [], (3, 128, 128)),
    ],
)
def test_families_run_on_cpu(name: str, kwargs: list[str], shape: tuple[int, ...]) -> None:
    model, _, example = _example(
        f"torchvision:{name}", "cpu", kwargs, batch_size=2, input_shape=shape
    )
    assert all(tuple(x.shape) == (2, *shape) for x in example.args)
    _, loss = _step(model, example)
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    ("name", "losses"),
    [
        ("fasterrcnn_mobilenet_v3_large_320_fpn", {"loss_classifier"}),
        ("maskrcnn_resnet50_fpn", {"loss_classifier", "loss_mask"}),
        ("keypointrcnn_resnet50_fpn", {"loss_classifier", "loss_keypoint"}),
    ],
)
def test_detection_targets_train_every_head_on_cpu(name: str, losses: set[str]) -> None:
    model, _, example = _example(
        f"torchvision:{name}", "cpu", SMALL_DETECTION, batch_size=2, input_shape=(3, 64, 64)
    )
    for target in example.args[1]:
        x1, y1, x2, y2 = target["boxes"].unbind(1)
        inside = (x1 >= 0) & (x1 < x2) & (x2 <= 64) & (y1 >= 0) & (y1 < y2) & (y2 <= 64)
        assert bool(inside.all())
    output, loss = _step(model, example)
    assert losses <= set(output)
    torch.testing.assert_close(loss, sum(output.values()))


# -- dtype, device, determinism, overrides -------------------------------------------------------


def test_cpu_inputs_are_seeded_and_uniform_images() -> None:
    first = _example("torchvision:resnet18", "cpu", batch_size=2, input_shape=(3, 8, 8))[2]
    second = _example("torchvision:resnet18", "cpu", batch_size=2, input_shape=(3, 8, 8))[2]
    torch.testing.assert_close(first.args[0], second.args[0], rtol=0, atol=0)
    assert first.args[0].min() >= 0 and first.args[0].max() < 1
    assert first.args[0].std() > 0.2  # not a constant


def test_dtype_applies_to_floats_only() -> None:
    _, _, example = _example(
        "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn",
        "meta",
        dtype=torch.bfloat16,
        batch_size=1,
    )
    images, targets = example.args
    assert images[0].dtype == targets[0]["boxes"].dtype == torch.bfloat16
    assert targets[0]["labels"].dtype == torch.int64


def test_batch_size_and_input_shape_override_the_defaults() -> None:
    _, _, example = _example("torchvision:resnet18", "meta", batch_size=3, input_shape=[3, 32, 48])
    assert (example.batch_size, tuple(example.args[0].shape)) == (3, (3, 3, 32, 48))
    _, _, detection = _example(
        "torchvision:ssdlite320_mobilenet_v3_large", "meta", batch_size=2, input_shape=(3, 50, 60)
    )
    images, targets = detection.args
    assert [tuple(i.shape) for i in images] == [(3, 50, 60)] * 2 and len(targets) == 2


# -- Hugging Face --------------------------------------------------------------------------------


def _hf_dir(tmp_path: Path, family: str) -> str:
    transformers = pytest.importorskip("transformers")
    config = {
        "llama": lambda: transformers.LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=50,
            max_position_embeddings=24,
        ),
        "t5": lambda: transformers.T5Config(
            d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=50
        ),
        "bert": lambda: transformers.BertConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            vocab_size=50,
        ),
    }[family]()
    config.save_pretrained(tmp_path)
    return f"hf:{tmp_path}"


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_causal_lm_gets_token_ids_and_labels(tmp_path: Path, device: str) -> None:
    model, _, example = _example(_hf_dir(tmp_path, "llama"), device, batch_size=2)
    assert (example.family, example.args, example.differentiable) == ("hf", (), ())
    assert set(example.kwargs) == {"input_ids", "labels"}
    ids = example.kwargs["input_ids"]
    assert (tuple(ids.shape), ids.dtype) == ((2, 24), torch.int64)  # capped at the position limit
    if device == "cpu":
        assert int(ids.min()) >= 0 and int(ids.max()) < 50
    output, loss = _step(model, example)
    assert loss is output.loss


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_differentiable_input_means_embeddings(tmp_path: Path, device: str) -> None:
    model, _, example = _example(_hf_dir(tmp_path, "llama"), device, batch_size=2, input_grad=True)
    embeds = example.kwargs["inputs_embeds"]
    assert set(example.kwargs) == {"inputs_embeds", "labels"}
    assert example.differentiable == (embeds,)
    assert (tuple(embeds.shape), embeds.dtype) == ((2, 24, 16), torch.float32)
    _step(model, example)


def test_embeddings_can_be_forced_as_the_paper_did(tmp_path: Path) -> None:
    _, _, example = _example(
        _hf_dir(tmp_path, "llama"), "meta", batch_size=2, embeds=True, dtype=torch.bfloat16
    )
    assert example.kwargs["inputs_embeds"].dtype == torch.bfloat16


@pytest.mark.parametrize("embeds", [False, True])
def test_seq2seq_gets_decoder_inputs(tmp_path: Path, embeds: bool) -> None:
    model, _, example = _example(
        _hf_dir(tmp_path, "t5"), "cpu", batch_size=2, input_shape=(10,), embeds=embeds
    )
    first = "inputs_embeds" if embeds else "input_ids"
    assert set(example.kwargs) == {first, "decoder_input_ids", "labels"}
    assert tuple(example.kwargs["decoder_input_ids"].shape) == (2, 10)
    output, loss = _step(model, example)
    assert loss is output.loss


def test_a_sequence_beyond_learned_positions_is_refused(tmp_path: Path) -> None:
    """BERT's positions are a table of 512 rows: a longer sequence fails on real data, while
    the meta device would estimate it. LLaMA's rotary positions take any length."""
    with pytest.raises(SpecError, match="513 tokens overruns the model's 512 learned positions"):
        _example(_hf_dir(tmp_path / "bert", "bert"), "meta", batch_size=1, input_shape=(513,))
    _, _, example = _example(
        _hf_dir(tmp_path / "llama", "llama"), "meta", batch_size=1, input_shape=(40,)
    )
    assert tuple(example.kwargs["input_ids"].shape) == (1, 40)  # beyond its 24 positions


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_encoder_without_head_sums_its_outputs(tmp_path: Path, device: str) -> None:
    model, _, example = _example(_hf_dir(tmp_path, "bert"), device, batch_size=2, input_shape=(12,))
    assert set(example.kwargs) == {"input_ids"}
    output, loss = _step(model, example)
    if device == "cpu":
        torch.testing.assert_close(
            loss, output.last_hidden_state.sum() + output.pooler_output.sum()
        )


def _vit_dir(tmp_path: Path, head: str | None) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=32,
        patch_size=8,
        num_labels=5,
        architectures=[head] if head else None,
    )
    config.save_pretrained(tmp_path)
    return f"hf:{tmp_path}"


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_vision_classifier_gets_pixels_and_class_labels(tmp_path: Path, device: str) -> None:
    """Pixel values as the config describes its images, differentiable; class labels, so the
    model returns its own loss."""
    text = _vit_dir(tmp_path, "ViTForImageClassification")
    model, _, example = _example(text, device, batch_size=2)
    assert set(example.kwargs) == {"pixel_values", "labels"}
    pixels, labels = example.kwargs["pixel_values"], example.kwargs["labels"]
    assert (tuple(pixels.shape), pixels.dtype) == ((2, 3, 32, 32), torch.float32)
    assert example.differentiable == (pixels,)
    assert (tuple(labels.shape), labels.dtype) == ((2,), torch.int64)
    if device == "cpu":
        assert int(labels.min()) >= 0 and int(labels.max()) < 5
    output, loss = _step(model, example)
    assert loss is output.loss


def test_vision_model_without_head_takes_the_shape_asked_for(tmp_path: Path) -> None:
    model, _, example = _example(_vit_dir(tmp_path, None), "meta", input_shape=(3, 40, 48))
    assert type(model).__name__ == "ViTModel"
    assert set(example.kwargs) == {"pixel_values"}  # no head, no labels: the outputs are summed
    assert tuple(example.kwargs["pixel_values"].shape) == (64, 3, 40, 48)


def _speech_dir(tmp_path: Path, family: str) -> str:
    transformers = pytest.importorskip("transformers")
    config = {
        "whisper": lambda: transformers.WhisperConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=40,
            num_mel_bins=8, max_source_positions=12, max_target_positions=10, pad_token_id=1,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
            architectures=["WhisperForConditionalGeneration"],
        ),
        "wav2vec2": lambda: transformers.Wav2Vec2Config(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
        ),
    }[family]()  # fmt: skip
    config.save_pretrained(tmp_path)
    return f"hf:{tmp_path}"


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_whisper_gets_mel_frames_decoder_ids_and_labels(tmp_path: Path, device: str) -> None:
    """Log-mel frames exactly as Whisper's encoder takes them (twice its source positions) and
    token ids for its decoder, up to its target positions, with labels: its own loss."""
    model, _, example = _example(_speech_dir(tmp_path, "whisper"), device, batch_size=2)
    features = example.kwargs["input_features"]
    assert set(example.kwargs) == {"input_features", "decoder_input_ids", "labels"}
    assert tuple(features.shape) == (2, 8, 24) and example.differentiable == (features,)
    assert tuple(example.kwargs["labels"].shape) == (2, 10)
    output, loss = _step(model, example)
    assert loss is output.loss


def test_waveform_model_gets_a_second_of_audio(tmp_path: Path) -> None:
    """Not differentiable: wav2vec 2.0 sets requires_grad on a view of its waveform in training,
    which raises where the waveform requires grad."""
    model, _, example = _example(_speech_dir(tmp_path, "wav2vec2"), "cpu", batch_size=2)
    waveform = example.kwargs["input_values"]
    assert set(example.kwargs) == {"input_values"} and tuple(waveform.shape) == (2, 16000)
    assert example.differentiable == ()
    _step(model.train(), example)


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_hf_models_of_two_towers_get_token_ids_and_pixels(tmp_path: Path, family: str) -> None:
    """CLIP and SigLIP read token ids and pixel values together (and have no one embedding
    table): ids as long as the text tower's positions allow, images as the vision tower's
    config describes them, and the contrastive loss the model computes itself."""
    transformers = pytest.importorskip("transformers")
    tower = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    text = {**tower, "intermediate_size": 32, "vocab_size": 50, "max_position_embeddings": 24}
    vision = {**tower, "intermediate_size": 32, "image_size": 32, "patch_size": 8}
    config_class = {"clip": transformers.CLIPConfig, "siglip": transformers.SiglipConfig}[family]
    config_class(text_config=text, vision_config=vision).save_pretrained(tmp_path)
    model, _, example = _example(f"hf:{tmp_path}", "cpu", batch_size=2)
    assert set(example.kwargs) == {"input_ids", "pixel_values", "return_loss"}
    assert tuple(example.kwargs["input_ids"].shape) == (2, 24)
    assert int(example.kwargs["input_ids"].max()) < 50
    assert tuple(example.kwargs["pixel_values"].shape) == (2, 3, 32, 32)
    assert example.differentiable == (example.kwargs["pixel_values"],)
    output, loss = _step(model.train(), example)
    assert loss is output.loss  # the model's own contrastive loss


def test_hf_model_fed_neither_way_says_what_to_do(tiny_time_series_dir: Path) -> None:
    """A time-series model reads past values: neither tokens, pixels, audio nor pairs."""
    message = "PatchTSTForPrediction takes neither token ids, pixel values nor audio alone (its "
    with pytest.raises(SpecError, match=re.escape(message) + "forward takes none of them"):
        _example(f"hf:{tiny_time_series_dir}", "meta", batch_size=2)


# -- user callables ------------------------------------------------------------------------------


def _user(attr: str, device: str = "cpu", **extra: object) -> tuple[nn.Module, ModelSpec, Example]:
    return _example(f"{MODELS_FILE}:{attr}", device, **extra)


def test_companion_tensor() -> None:
    model, _, example = _user("make_mlp", batch_size=5)
    (x,) = example.args
    assert (example.family, tuple(x.shape), example.differentiable) == ("callable", (5, 8), (x,))
    torch.testing.assert_close(x, _user("make_mlp", batch_size=5)[2].args[0], rtol=0, atol=0)
    _step(model, example)


def test_companion_default_batch_and_dtype() -> None:
    _, _, example = _user("make_mlp", dtype=torch.float64)
    assert (tuple(example.args[0].shape), example.args[0].dtype) == ((64, 8), torch.float64)


def test_companion_tuple_on_meta() -> None:
    model, _, example = _user("make_two", "meta", batch_size=3)
    x, y = example.args
    assert (x.device.type, tuple(x.shape), tuple(y.shape)) == ("meta", (3, 4), (3, 5))
    assert example.differentiable == (x, y)
    _step(model, example)


def test_companion_dict_becomes_keywords() -> None:
    model, _, example = _user("make_keywords", batch_size=2)
    assert example.args == () and set(example.kwargs) == {"x", "y", "scale"}
    assert example.kwargs["scale"] == 2.0
    output, loss = _step(model, example)
    torch.testing.assert_close(loss, output.sum())


def test_companion_integer_inputs_keep_their_dtype() -> None:
    model, _, example = _user("make_embedder", batch_size=2, dtype=torch.float16)
    (ids,) = example.args
    assert ids.dtype == torch.int64 and example.differentiable == ()
    assert model(ids).dtype == torch.float32  # the model's dtype is the caller's business


def test_input_shape_beats_the_companion() -> None:
    _, _, example = _user("make_mlp", batch_size=2, input_shape=(8,), device="meta")
    assert (example.family, tuple(example.args[0].shape)) == ("tensor", (2, 8))


@pytest.mark.parametrize(("attr", "shape"), [("make_conv", (2, 3, 224, 224))])
def test_shape_is_guessed_from_the_first_layer(attr: str, shape: tuple[int, ...]) -> None:
    model, _, example = _user(attr, "meta", batch_size=2)
    assert tuple(example.args[0].shape) == shape
    _step(model, example)


def test_shape_guess_for_a_linear_model(tmp_path: Path) -> None:
    path = tmp_path / "plain.py"
    path.write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(7, 2))\n"
    )
    _, _, example = _example(f"{path}:make", "meta", batch_size=4)
    assert tuple(example.args[0].shape) == (4, 7)


def test_a_declared_input_size_beats_the_first_layer(tmp_path: Path) -> None:
    """timm's convention (``pretrained_cfg["input_size"]``), whoever built the model: MaxViT's
    windows fail at the 224x224 a first convolution would suggest."""
    path = tmp_path / "declared.py"
    path.write_text(
        "import torch\n"
        "def make():\n"
        "    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))\n"
        "    model.pretrained_cfg = {'input_size': (3, 40, 48)}\n"
        "    return model\n"
    )
    _, _, example = _example(f"{path}:make", "meta", batch_size=2)
    assert tuple(example.args[0].shape) == (2, 3, 40, 48)


def test_timm_models_get_the_input_size_they_declare() -> None:
    pytest.importorskip("timm")
    model, _, example = _example("timm:test_vit", "meta", batch_size=2)
    assert (
        tuple(example.args[0].shape) == (2, *model.pretrained_cfg["input_size"]) == (2, 3, 160, 160)
    )
    _, _, example = _example("timm:test_vit", "meta", batch_size=2, input_shape=(3, 96, 96))
    assert tuple(example.args[0].shape) == (2, 3, 96, 96)
    # Keyword arguments that change the model: timm keeps the declared size, the model does not.
    for kwargs, shape in ((["img_size=96"], (2, 3, 96, 96)), (["in_chans=1"], (2, 1, 160, 160))):
        model, _, example = _example("timm:test_vit", "meta", kwargs, batch_size=2)
        assert tuple(example.args[0].shape) == shape
    model, _, example = _example("timm:test_resnet", "meta", ["in_chans=1"], batch_size=2)
    assert tuple(example.args[0].shape)[:2] == (2, 1)


def test_nothing_to_guess_from_says_what_to_do() -> None:
    with pytest.raises(SpecError) as info:
        _user("make_activation", batch_size=2)
    assert str(info.value) == (
        f"cannot guess inputs for {MODELS_FILE}:make_activation: define make_activation_inputs(batch_size) "
        "next to it, or give an input shape"
    )


def test_companion_that_returns_something_else() -> None:
    with pytest.raises(SpecError) as info:
        _user("make_bad", batch_size=2)
    assert str(info.value).endswith(
        "make_bad_inputs returned int; expected a tensor, tuple or dict"
    )


def test_companion_that_raises() -> None:
    with pytest.raises(SpecError) as info:
        _user("make_raising", batch_size=2)
    assert str(info.value).endswith("make_raising_inputs(2) raised RuntimeError: no data today")


# -- loss_of -------------------------------------------------------------------------------------


def _leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=generator, requires_grad=True) for shape in shapes]


def test_loss_of_a_tensor_is_its_sum() -> None:
    (x,) = _leaves((3, 4))
    torch.testing.assert_close(loss_of(x), x.sum())


def test_loss_of_nested_outputs_sums_every_floating_tensor_once() -> None:
    a, b, c = _leaves((2,), (3, 1), (4,))
    output = (a, [b, {"c": c, "count": torch.tensor([1, 2]), "name": "x"}], None, 7)
    loss = loss_of(output)
    torch.testing.assert_close(loss, a.sum() + b.sum() + c.sum())
    loss.backward()
    for leaf in (a, b, c):
        torch.testing.assert_close(leaf.grad, torch.ones_like(leaf))


def test_loss_of_a_detection_loss_dict_is_the_sum_of_its_losses() -> None:
    values = _leaves((), (), ())
    losses = {"loss_classifier": values[0], "loss_box_reg": values[1], "loss_objectness": values[2]}
    torch.testing.assert_close(loss_of(losses), values[0] + values[1] + values[2])


def test_loss_of_prefers_the_models_own_loss() -> None:
    loss, logits = _leaves((), (2, 3))

    class Output(OrderedDict):
        @property
        def loss(self) -> torch.Tensor:
            return self["loss"]

    assert loss_of(Output(loss=loss, logits=logits)) is loss
    assert loss_of({"loss": loss, "logits": logits}) is loss
    assert loss_of(Output(loss=None, logits=logits)) is not None  # None loss: fall back to the sum
    torch.testing.assert_close(loss_of({"loss": None, "logits": logits}), logits.sum())


def test_loss_of_sums_in_the_promoted_dtype() -> None:
    half = torch.ones(3, dtype=torch.bfloat16)
    full = torch.ones(2, dtype=torch.float32)
    assert loss_of((half, full)).dtype == torch.float32


def test_loss_of_an_output_without_floats_is_an_error() -> None:
    with pytest.raises(SpecError, match=r"the model output \(tuple\) holds no floating tensor"):
        loss_of((torch.tensor([1, 2]), "text"))

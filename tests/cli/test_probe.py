"""``memsave probe``: the visual-abstract curves, checked against counts by hand."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from memsave_cli.cli import app
from memsave_cli.probe import LAYERS, ProbeError, probe

T = 2**29  # every probe input and hidden tensor takes 512 MiB in float32
CONV2D_WEIGHT = 2560  # 8*8*3*3 float32 = 2304 bytes, rounded up to 512-byte blocks


@pytest.mark.parametrize("layer", list(LAYERS))
def test_paper_inputs_take_512_mib(layer):
    shape = LAYERS[layer].input_shape
    numel = 1
    for size in shape:
        numel *= size
    assert numel * 4 == T


def test_conv2d_curves_by_hand():
    result = probe("conv2d", depths=range(1, 7))
    assert result.metric == "forward_peak" and not result.errors.get("all")
    for index, depth in enumerate(result.depths):
        params = depth * CONV2D_WEIGHT
        # All trainable: the input, and every layer's output (the next layer's saved input).
        assert result.curves["all"][index] == (depth + 1) * T + params
        # Nothing trainable: input, the layer's input and output are live at once.
        assert result.curves["none"][index] == min(depth + 1, 3) * T + params
        # Training layer 4 onwards keeps the inputs of layers 4..depth.
        kept = max(depth - 3, 0)
        expected = (min(depth + 1, 3) if kept == 0 else 2 + kept) * T + params
        assert result.curves["from4"][index] == expected


@pytest.mark.parametrize("layer", ["conv1d", "conv_transpose2d", "bn2d"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_stock_keeps_inputs_after_the_trained_layer(layer, mode):
    result = probe(layer, depths=(6,), mode=mode)
    assert result.curves["only4"] == result.curves["from4"]
    assert result.curves["none"][0] < result.curves["only4"][0] < result.curves["all"][0]


def test_linear_is_already_optimal():
    result = probe("linear", depths=(6,))
    assert result.curves["only4"][0] < result.curves["from4"][0]
    # Only layer 4's input is kept on top of what an inference pass holds.
    assert result.curves["only4"][0] - result.curves["none"][0] == pytest.approx(T, rel=1e-3)


@pytest.mark.parametrize(("layer", "mode"), [("conv2d", "train"), ("bn2d", "eval")])
def test_memsave_keeps_only_layer_4_input(layer, mode):
    result = probe(layer, depths=(5, 6, 8), mode=mode)
    assert "only4-memsave" not in result.errors
    for index, depth in enumerate(result.depths):
        params = depth * 2560  # conv2d weight, or bn2d's five tensors, in 512-byte blocks
        # memsave: input, layer 4's input (kept for its weight), the current layer's in and out,
        # give or take a few one-element stand-ins its backward needs for shapes.
        assert result.curves["only4-memsave"][index] == pytest.approx(4 * T + params, abs=2**16)
        # stock: also every later layer's input, as if all later layers were trained.
        assert result.curves["only4"][index] == pytest.approx((depth - 1) * T + params, abs=2**16)


def test_compiled_conv2d_keeps_what_the_partitioner_saves():
    result = probe("conv2d", depths=(2, 5), compiled=True)
    assert result.metric == "kept_after_forward"
    assert not result.errors  # memsave's convolution asked autocast about meta while traced
    assert result.curves["only4"] == result.curves["from4"]  # compiled stock: same finding
    params = 5 * CONV2D_WEIGHT
    # Kept after forward with nothing trainable: the input and the output.
    assert result.curves["none"][1] == 2 * T + params
    assert result.curves["all"][1] == (5 + 1) * T + params


def test_probe_takes_a_torch_device_and_any_iterable_of_depths():
    result = probe("linear", depths=iter([2, 1]), device=torch.device("meta"))
    assert result.device == "meta" and result.depths == (2, 1)
    assert result.curves["all"][1] < result.curves["all"][0]


def test_batch_size_scales_the_input():
    result = probe("conv2d", depths=(1,), batch_size=2)
    assert result.input_shape == (2, 8, 256, 256)
    assert result.curves["none"][0] == 2 * (T // 128) + CONV2D_WEIGHT


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer": "conv4d"}, "unknown probe layer"),
        ({"layer": "conv2d", "depths": (0, 1)}, "each depth must be a positive integer, got 0"),
        ({"layer": "conv2d", "depths": (2.5,)}, "each depth must be a positive integer, got 2.5"),
        ({"layer": "conv2d", "depths": (True,)}, "each depth must be a positive integer, got True"),
        ({"layer": "conv2d", "depths": (501,)}, "each depth must be at most 500"),
        ({"layer": "conv2d", "depths": "3"}, r"depths must be positive layer counts, e\.g\."),
        ({"layer": "conv2d", "depths": ()}, "depths must be positive layer counts, e.g. .* none"),
        ({"layer": "conv2d", "mode": "test"}, "mode must be"),
        ({"layer": "conv2d", "batch_size": 0}, "batch size must be a positive integer"),
        ({"layer": "conv2d", "batch_size": 2.0}, "batch size must be a positive integer, got 2.0"),
        ({"layer": "conv2d", "batch_size": True}, "must be a positive integer, got True"),
        ({"layer": "conv2d", "device": "cuda:1"}, "memsave measures on the current device"),
        ({"layer": "conv2d", "device": "tpu"}, "unknown device 'tpu'"),
    ],
)
def test_probe_errors(kwargs, message):
    with pytest.raises(ProbeError, match=message):
        probe(**kwargs)


def test_probe_command_writes_table_json_and_plot(runner, tmp_path):
    pytest.importorskip("matplotlib")
    plot, data = tmp_path / "probe.png", tmp_path / "probe.json"
    args = ["probe", "conv2d", "--depth", "5", "--plot", str(plot), "--json", str(data)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("Forward peak of conv2d stacks, train mode") == 1
    assert result.output.count("columns: which layers") == 1
    assert "plot written" in result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(data.read_text())
    assert saved["curves"]["all"] == list(probe("conv2d", depths=range(1, 6)).curves["all"])
    table_rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert len(table_rows) == 5 and "3.00 GiB" in table_rows[4]  # depth 5, all: 6 tensors


def test_probe_json_to_stdout_keeps_table_off_stdout(runner):
    result = runner.invoke(app, ["probe", "linear", "--depth", "2", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layer"] == "linear"


def test_probe_without_matplotlib_says_so_before_probing(runner, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    probed = []
    monkeypatch.setattr("memsave_cli.probe.probe", lambda *a, **k: probed.append(1))
    result = runner.invoke(
        app, ["probe", "linear", "--depth", "2", "--plot", str(tmp_path / "p.png")]
    )
    assert result.exit_code == 2, result.output
    assert "plotting needs matplotlib" in result.output
    assert not probed and not (tmp_path / "p.png").exists()


def test_probe_refuses_a_plot_on_stdout(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["probe", "linear", "--depth", "2", "--plot", "-"])
    assert result.exit_code == 2, result.output
    assert "--plot -: a PNG does not go to stdout" in result.output
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["probe", "conv4d"], "conv4d"),
        (["probe", "conv2d", "--depth", "0"], "--depth"),
        (["probe", "conv2d", "--depth", "100000"], "500"),  # ~5e9 layers; click words it its way
        (["probe", "conv2d", "--batch-size", "-1"], "--batch-size"),
        (["probe", "conv2d", "--mode", "test"], "--mode"),
    ],
)
def test_probe_bad_options_exit_2(runner, args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_probe_cuda_without_gpu_exits_2(runner):
    result = runner.invoke(app, ["probe", "conv2d", "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "no CUDA device" in result.output


def test_probe_where_every_cell_fails_exits_2(runner, monkeypatch):
    import memsave_cli.probe as core

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(core, "measure_stack", broken)
    result = runner.invoke(app, ["probe", "conv1d", "--depth", "2"])
    assert result.exit_code == 2, result.output
    assert "all failed: RuntimeError: kernel exploded" in result.output


def test_every_compiled_cell_is_compiled():
    """Every cell recompiles ``Sequential.forward``; past Dynamo's recompile limit (8) the rest
    ran uncompiled under a title saying torch.compile. Ten cells: ten graphs."""
    from torch._dynamo.utils import counters

    counters.clear()
    result = probe("linear", depths=(1, 2), compiled=True, batch_size=2)
    assert not result.errors
    assert counters["stats"]["unique_graphs"] == 2 * len(result.curves)

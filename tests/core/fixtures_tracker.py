"""Small models (module:callable specs) and worker behaviours for the measurement-core tests.

Models come with ``<name>_inputs(batch_size)``; ``behave`` is a runner target that does what the
job's spec attribute names (crash, raise, hang, return garbage), so that one ``run_jobs`` call can
mix failing and succeeding workers.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memsave_cli.report import Run


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10))


def mlp_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 100)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.Dropout(0.2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def small_cnn_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 3, 32, 32)


def blocks_cnn() -> nn.Module:
    """A stem and two blocks (``blocks.0``, ``blocks.1``) of memsave's CNN layers, and a head:
    the modules a checkpointing pattern selects."""

    def block(channels: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Dropout(0.2),
        )

    stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    return nn.Sequential(
        OrderedDict(stem=stem, blocks=nn.Sequential(block(8), block(8)), head=head)
    )


def blocks_cnn_inputs(batch_size: int) -> torch.Tensor:
    return small_cnn_inputs(batch_size)


def lazy_cnn() -> nn.Module:
    """``small_cnn`` with every layer that can be lazy built lazy: shapes come from the input."""
    return nn.Sequential(
        nn.LazyConv2d(16, 3, padding=1, bias=False),
        nn.LazyBatchNorm2d(),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.LazyConv2d(32, 3, padding=1),
        nn.LazyBatchNorm2d(),
        nn.ReLU(inplace=True),
        nn.Dropout(0.2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.LazyLinear(10),
    )


def lazy_cnn_inputs(batch_size: int) -> torch.Tensor:
    return small_cnn_inputs(batch_size)


class AttentionNet(nn.Module):
    """A pre-norm transformer block: layer norm, multi-head attention, GELU feed-forward."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.feed = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.feed(self.norm2(x))


def attention_net() -> nn.Module:
    return AttentionNet()


def attention_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 24, 32)


class ItemNet(nn.Module):
    """Branches on a tensor value, as detection models do: impossible without data."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if y.sum().item() > 0 else -y


def item_net() -> nn.Module:
    return ItemNet()


def item_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8)


class CtcNet(nn.Module):
    """Speech recognition's CTC loss inside the model: an operator without a meta kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = self.linear(x).log_softmax(-1).unsqueeze(1)  # (time, batch 1, classes)
        targets = torch.ones(1, 2, dtype=torch.long, device=x.device)
        lengths = torch.full((1,), x.size(0), dtype=torch.long, device=x.device)
        return F.ctc_loss(frames, targets, lengths, torch.full_like(lengths, 2))


def ctc_net() -> nn.Module:
    return CtcNet()


def ctc_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8)


class NoDataNet(nn.Module):
    """A model error whose words ("no data") are not meta's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no data loaded for this layer")


def no_data_net() -> nn.Module:
    return NoDataNet()


class OomNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")


def oom_net() -> nn.Module:
    return OomNet()


def oom_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8)


def patch_cnn() -> nn.Module:
    """A patch embedding whose weight outweighs its activations (a vision transformer's first
    layer at a small input), and a BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 14, stride=14), nn.BatchNorm2d(32), nn.Flatten(), nn.Linear(128, 4)
    )


def patch_cnn_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 3, 28, 28)


class AutocastOffNet(nn.Module):
    """Turns autocast off for the device of its weight around a matmul, as peft's LoRA on
    mixture-of-experts parameters does in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast(device_type=self.b.weight.device.type, enabled=False):
            return h.float() @ self.b.weight.t()


def autocast_off_net() -> nn.Module:
    return AutocastOffNet()


def autocast_off_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8)


def flat_mlp() -> nn.Module:
    """No normalisation layer: the norm case has nothing to train."""
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def flat_mlp_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16)


class MetricNet(nn.Module):
    """An MLP logging a metric computed under autograd and detached (not under ``no_grad``), as
    training code often does: the softmax's saved output dies with its graph at once."""

    def __init__(self, metric: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.probe, self.softmax = nn.Linear(16, 64), nn.Softmax(-1)
        self.tail = nn.Linear(16, 4)
        self.metric, self.confidence = metric, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        if self.metric:
            self.confidence = self.softmax(self.probe(hidden)).max(-1).values.mean().detach()
        return self.tail(hidden)


def metric_net() -> nn.Module:
    return MetricNet()


def quiet_net() -> nn.Module:
    return MetricNet(metric=False)


def metric_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16)


quiet_net_inputs = metric_net_inputs


class CheckpointedNet(nn.Module):
    """Blocks the model checkpoints itself (``use_reentrant`` as given)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)
        )
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def reentrant_net() -> nn.Module:
    return CheckpointedNet(reentrant=True)


def nonreentrant_net() -> nn.Module:
    return CheckpointedNet(reentrant=False)


reentrant_net_inputs = nonreentrant_net_inputs = metric_net_inputs


class GraphNet(nn.Module):
    """A graph convolution over a sparse ring adjacency of 64 nodes (three entries a row), held
    as a buffer or as a plain attribute; the batch is the node features."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        nodes = torch.arange(64)
        rows, cols = nodes.repeat(3), torch.cat([nodes, (nodes + 1) % 64, (nodes - 1) % 64])
        adjacency = torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.ones(192), (64, 64))
        if as_buffer:
            self.register_buffer("adjacency", adjacency)
        else:
            self.adjacency = adjacency
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adjacency, self.linear(x))


def sparse_buffer_net() -> nn.Module:
    return GraphNet(as_buffer=True)


def sparse_attribute_net() -> nn.Module:
    return GraphNet(as_buffer=False)


def sparse_buffer_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(64, 8)


sparse_attribute_net_inputs = sparse_buffer_net_inputs


# -- runner behaviours ----------------------------------------------------------------------------


class _Explodes:
    """Pickles fine in the worker, but unpickling it raises in the parent."""

    def __reduce__(self):
        return (_explode, ())


def _explode() -> None:
    raise ValueError("cannot rebuild this object")


def behave(job) -> Run:
    """Runner target: act as ``job.spec.attr`` says; the ok kinds report facts about the worker."""
    action = job.spec.attr
    if action == "ok":
        return Run(job.case.label, job.impl, param_bytes=os.getpid(), saved_bytes=_preloaded())
    if action == "sigint":  # whether the worker ignores Ctrl-C
        ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        return Run(job.case.label, job.impl, saved_bytes=int(ignored))
    if action == "nap":
        start = time.time()
        time.sleep(1.0)
        return Run(job.case.label, job.impl, time_s=start, peak_bytes=int(time.time() * 1000))
    if action == "refault":
        return Run(job.case.label, job.impl, saved_bytes=_refaults(64 << 20))
    if action == "exit":
        print("clue: about to exit", file=sys.stderr, flush=True)
        os._exit(3)
    if action == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if action == "raise":
        raise ValueError("boom\nsecond line of the message")
    if action == "hang":
        with open(job.spec.target, "w") as handle:
            handle.write(str(os.getpid()))
        time.sleep(600)
    if action == "garbage":
        return {"not": "a run"}  # type: ignore[return-value]
    if action == "unpicklable":
        return _Explodes()  # type: ignore[return-value]
    raise AssertionError(f"unknown behaviour {action}")


def _refaults(size: int, rounds: int = 10, counted: int = 4) -> int:
    """Page faults of the last ``counted`` of ``rounds`` rounds that each fill a buffer of ``size``
    bytes allocated right after an equal one was freed, as training steps do (none once the heap
    keeps the freed memory)."""
    faults = 0
    for index in range(rounds):
        torch.ones(size // 4)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(size // 4)
        if index >= rounds - counted:
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults


def _preloaded() -> int:
    """1 when torchvision was imported before this worker ran (the fork server preloads it)."""
    return int("torchvision" in sys.modules)


class SmallTransformer(nn.Module):
    """The paper's vanilla Transformer in miniature: encoder-decoder, ReLU, dropout 0.1 (also
    inside attention), a projection onto a small vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=32,
            nhead=4,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=48,
            dropout=0.1,
            batch_first=True,
        )
        self.pred = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.transformer.encoder(x)
        return self.pred(self.transformer.decoder(x, memory))


def small_transformer() -> nn.Module:
    return SmallTransformer()


def small_transformer_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 12, 32)


class LayerDropNet(nn.Module):
    """Eight blocks of dropout then a layer each skips in training when ``torch.rand([])`` falls
    below one half (LayerDrop, as wav2vec 2.0 skips encoder layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.drops = nn.ModuleList(nn.Dropout(0.1) for _ in range(8))
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for drop, layer in zip(self.drops, self.layers, strict=True):
            x = drop(x)
            if not self.training or torch.rand([]) >= 0.5:
                x = layer(x)
        return x


def layer_drop_net() -> nn.Module:
    return LayerDropNet()


def layer_drop_net_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16)

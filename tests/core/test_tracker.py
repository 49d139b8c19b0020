"""MemoryTracker on networks whose memory can be counted by hand, and meta == cpu on small models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_cli.tracker import ALLOCATOR_ROUND, MemoryTracker, round_bytes

F32 = 4


def rounded(*shapes: tuple[int, ...], itemsize: int = F32) -> int:
    """Bytes the CUDA allocator would hold for float tensors of these shapes (512-byte blocks)."""
    total = 0
    for shape in shapes:
        nbytes = itemsize * torch.Size(shape).numel()
        total += -(-nbytes // 512) * 512
    return total


def param_bytes(model: nn.Module) -> int:
    return rounded(*(tuple(p.shape) for p in model.parameters()))


@pytest.mark.parametrize(
    ("nbytes", "expected"), [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (4000, 4096)]
)
def test_round_bytes_matches_allocator_blocks(nbytes: int, expected: int) -> None:
    assert ALLOCATOR_ROUND == 512
    assert round_bytes(nbytes) == expected


def test_track_counts_each_storage_once() -> None:
    x = torch.randn(10, 30)
    tracker = MemoryTracker()
    assert tracker.track(x, [x[1:], x.t()], {"again": x}) == rounded((10, 30))
    assert tracker.track(x) == 0
    assert tracker.current_bytes == tracker.peak_bytes == rounded((10, 30))


def test_views_and_inplace_ops_allocate_nothing() -> None:
    tracker = MemoryTracker()
    with tracker:
        a = torch.randn(64, 33)
        after_alloc = tracker.current_bytes
        a.relu_().mul_(2.0)
        views = (a.view(-1), a.t(), a[::2], a.expand(2, 64, 33), a.unsqueeze(0))
        assert tracker.current_bytes == after_alloc == rounded((64, 33))
        b = a + 1.0
        assert tracker.current_bytes == 2 * rounded((64, 33))
    del views, b
    assert tracker.current_bytes == rounded((64, 33))


def test_view_of_unregistered_tensor_is_not_new_memory() -> None:
    outside = torch.randn(100, 7)
    tracker = MemoryTracker()
    with tracker:
        view = outside.view(7, 100)
        copy = view.clone()
    assert tracker.current_bytes == rounded((7, 100))
    del view, copy


def test_freed_storages_are_subtracted_and_peak_is_kept() -> None:
    tracker = MemoryTracker()
    with tracker:
        a = torch.zeros(1000)
        b = torch.ones(3000)
        del a
        assert tracker.current_bytes == rounded((3000,))
        assert tracker.peak_bytes == rounded((1000,), (3000,))
        assert tracker.reset_peak() == rounded((3000,))
        del b
    assert tracker.current_bytes == 0
    assert tracker.peak_bytes == rounded((3000,))


def test_resize_in_place_is_counted() -> None:
    tracker = MemoryTracker()
    with tracker:
        a = torch.empty(0)
        assert tracker.current_bytes == 0
        a.resize_(1000)
    assert tracker.current_bytes == rounded((1000,))
    del a
    assert tracker.current_bytes == 0


# What each sparse layout keeps, read with its own accessors.
SPARSE_PARTS = {
    torch.sparse_coo: lambda t: (t._indices(), t._values()),
    torch.sparse_csr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_csc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
}


@pytest.mark.filterwarnings("ignore:Sparse")
@pytest.mark.parametrize("layout", list(SPARSE_PARTS))
def test_sparse_tensors_count_their_indices_and_values(layout: torch.layout) -> None:
    dense = torch.zeros(300, 200)
    dense[::3, ::7] = 1.5
    sparse = dense.to_sparse(layout=layout)
    storages = {id(p.untyped_storage()): p.untyped_storage() for p in SPARSE_PARTS[layout](sparse)}
    held = sum(round_bytes(s.nbytes()) for s in storages.values())
    assert 0 < held < rounded((300, 200))
    assert MemoryTracker().track(sparse) == held  # a sparse buffer
    tracker = MemoryTracker()
    with tracker:
        made = dense.to_sparse(layout=layout)
        assert tracker.current_bytes == held
    del made
    assert tracker.current_bytes == 0 and tracker.peak_bytes >= held


def test_tensor_literals_are_counted() -> None:
    tracker = MemoryTracker()
    with tracker:
        c = torch.tensor([1.0, 2.0, 3.0])
    assert tracker.current_bytes == rounded((3,))
    del c


def test_mlp_forward_peak_by_hand() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10))
    x = torch.randn(8, 100)
    tracker = MemoryTracker()
    tracker.track_module(model)
    tracker.track(x)
    with tracker:
        out = model(x)
    # addmm's output h (8, 300) and ReLU's output r (8, 300) are both live right after the ReLU;
    # h dies there (addmm saves x and W, not its output), so the second layer adds only (8, 10).
    base = param_bytes(model) + rounded((8, 100))
    assert tracker.peak_bytes == base + 2 * rounded((8, 300))
    assert tracker.current_bytes == base + rounded((8, 300), (8, 10))
    del out


def test_conv_relu_forward_by_hand() -> None:
    conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
    x = torch.randn(2, 3, 16, 16)
    tracker = MemoryTracker()
    tracker.track_module(conv)
    tracker.track(x)
    assert tracker.current_bytes == rounded((8, 3, 3, 3), (8,), (2, 3, 16, 16))
    with tracker:
        out = torch.relu_(conv(x))
    assert tracker.current_bytes == tracker.peak_bytes
    assert tracker.current_bytes == rounded((8, 3, 3, 3), (8,), (2, 3, 16, 16), (2, 8, 16, 16))
    del out


def test_backward_frees_the_graph_and_keeps_gradients() -> None:
    model = nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10))
    x = torch.randn(8, 100, requires_grad=True)
    tracker = MemoryTracker()
    tracker.track_module(model)
    tracker.track(x)
    before = tracker.current_bytes
    with tracker:
        model(x).sum().backward()
        # everything the graph held is gone; .grad of each parameter and of x remains
        assert tracker.current_bytes == 2 * before
        model(x).sum().backward()  # accumulating into existing .grad allocates nothing new
        assert tracker.current_bytes == 2 * before
    assert tracker.peak_bytes > 2 * before
    model.zero_grad(set_to_none=True)
    x.grad = None
    assert tracker.current_bytes == before


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_optimizer_states_are_counted(name: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10))
        x = torch.randn(8, 100)
    if name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    tracker = MemoryTracker("meta")
    tracker.track_module(model)
    tracker.track(x)
    with tracker:
        model(x).sum().backward()
        after_backward = tracker.current_bytes
        optimizer.step()
    states = 1 if name == "sgd" else 2  # momentum buffer; exp_avg and exp_avg_sq
    # Adam's step counters live on the cpu, not on the tracked device
    assert tracker.current_bytes - after_backward == states * param_bytes(model)


def test_device_filter_ignores_other_devices() -> None:
    tracker = MemoryTracker("meta")
    with tracker:
        host = torch.ones(1000)
        dev = torch.ones(1000, device="meta")
    assert tracker.current_bytes == rounded((1000,))
    del host, dev


def test_detach_freezes_counts() -> None:
    tracker = MemoryTracker()
    with tracker:
        a = torch.ones(1000)
    tracker.detach()
    del a
    assert tracker.current_bytes == rounded((1000,))


class SmallNet(nn.Module):
    """Convolutions, batch norm, group norm, pooling, dropout and layer norm in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
            nn.GroupNorm(4, 32),
            nn.SiLU(),
            nn.Dropout(0.1),
        )
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x).flatten(2).transpose(1, 2)
        h = self.norm(h)
        return self.head(nn.functional.gelu(h).mean(1))


def _step_counts(device: str, trainable: str) -> tuple[int, int, int]:
    torch.manual_seed(0)
    with torch.device(device):
        model = SmallNet()
        x = torch.randn(4, 3, 32, 32, requires_grad=trainable == "input")
    for name, p in model.named_parameters():
        p.requires_grad_(trainable == "all" or (trainable == "norm" and "norm" in name))
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable_params or [x], lr=0.1, momentum=0.9)
    tracker = MemoryTracker(device)
    tracker.track_module(model)
    tracker.track(x)
    with tracker:
        loss = model(x).sum()
        forward_peak = tracker.peak_bytes
        loss.backward()
        optimizer.step()
    return forward_peak, tracker.peak_bytes, tracker.current_bytes


@pytest.mark.parametrize("trainable", ["all", "input", "norm"])
def test_meta_equals_cpu(trainable: str) -> None:
    meta = _step_counts("meta", trainable)
    assert meta == _step_counts("cpu", trainable)
    assert meta[0] > param_bytes(SmallNet()) + rounded((4, 3, 32, 32))


class Log:
    """An observer that records what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []

    def allocated(self, token: int, nbytes: int) -> None:
        self.events.append(("alloc", token, nbytes))

    def freed(self, token: int) -> None:
        self.events.append(("free", token, 0))


def test_observer_sees_allocations_and_frees_in_order() -> None:
    log = Log()
    tracker = MemoryTracker(observer=log)
    with tracker:
        a = torch.ones(100)
        b = torch.ones(300)
        del a
        b.resize_(1000)
    del b
    kinds = [(kind, nbytes) for kind, _, nbytes in log.events]
    assert kinds == [
        ("alloc", 400),
        ("alloc", 1200),
        ("free", 0),
        ("free", 0),
        ("alloc", 4000),
        ("free", 0),
    ]
    tokens = [token for _, token, _ in log.events]
    assert tokens[0] == tokens[2] and tokens[1] == tokens[3] == tokens[4] == tokens[5]
    assert tokens[0] != tokens[1]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("op", [torch.log_softmax, torch.softmax])
def test_softmax_of_a_permuted_input_peaks_with_its_contiguous_copy(op, device: str) -> None:
    logits = torch.randn(4, 50, 30, device=device).permute(0, 2, 1)  # (B, V, L), not contiguous
    tracker = MemoryTracker(device)
    tracker.track(logits)
    with tracker:
        out = op(logits, dim=1)
        assert tracker.current_bytes == 2 * rounded((4, 30, 50))  # the copy is freed again
        assert tracker.peak_bytes == 3 * rounded((4, 30, 50))  # logits, copy and output at once
        contiguous = op(out, dim=1)
    assert contiguous.is_contiguous() and tracker.peak_bytes == 3 * rounded((4, 30, 50))

"""One rank of N under FSDP2: the model sharded by ``fully_shard`` as PyTorch's engine shards it.

NOTE [estimating a rank]: an estimate runs rank 0 of ``N`` in this process, on the meta device.
A fake process group (``torch.distributed``'s ``fake`` backend: collectives that move no data)
and a cpu device mesh of ``N`` ranks let ``fully_shard`` shard every parameter into a DTensor
whose local shard is 1/N of it, and allocate its all-gather, reduce-scatter and gradient
buffers as in a real job. Two things keep it on meta, where every other memsave estimate runs
(stock and memsave layers, attention and dropout as on CUDA): ``fully_shard`` is applied to
meta parameters, which FSDP2 supports for deferred initialisation, and FSDP2's refusal to
*train* meta parameters is lifted while the step runs; and the buffers FSDP2 allocates on its
mesh's device (cpu) are allocated on meta instead (``_CpuAsMeta``). The tracker counts each
DTensor by its local shard and follows the storage resizes by which FSDP2 frees and re-allocates
unsharded parameters (NOTE [sharded tensors]). A cpu job inside a running process group (the
validation test's gloo ranks) shards over that group instead, on real tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_cli.errors import MemsaveError

#: The device type of FSDP2's mesh: collectives on cpu need no accelerator.
MESH_DEVICE = "cpu"
_META = torch.device("meta")


class FsdpError(MemsaveError):
    """A sharded run cannot be set up (a bad world size, a process group of another size)."""


@dataclass
class World:
    """The mesh of ``size`` ranks this process plays one of; ``estimate``: a fake group on meta."""

    size: int
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    estimate: bool

    def shard(self, model: nn.Module, reshard: bool = True) -> nn.Module:
        """``fully_shard`` each unit of ``model`` (``shard_units``), then the root. ``reshard``
        is FSDP2's default (units reshard after forward, the root does not, as backward needs
        it at once); without it every unit keeps its parameters gathered until backward."""
        from torch.distributed.fsdp import fully_shard

        after_forward = None if reshard else False
        for unit in shard_units(model):
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=after_forward)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=after_forward)
        return model

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Where the sharded model steps: for an estimate, with meta parameters allowed and
        FSDP2's buffers on meta (NOTE [estimating a rank]); for real ranks, as it is."""
        if not self.estimate:
            yield
            return
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        validate = FSDPParamGroup._validate_no_meta_params
        FSDPParamGroup._validate_no_meta_params = lambda group: None  # type: ignore[method-assign]
        try:
            with _CpuAsMeta():
                yield
        finally:
            FSDPParamGroup._validate_no_meta_params = validate  # type: ignore[method-assign]


class _CpuAsMeta(TorchDispatchMode):
    """Every op asked to allocate on cpu allocates on meta instead (FSDP2's mesh device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _on_mesh_device(kwargs.get("device")) or any(map(_on_mesh_device, args)):
            args = tuple(_META if _on_mesh_device(a) else a for a in args)
            kwargs = {k: _META if _on_mesh_device(v) else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _on_mesh_device(value: object) -> bool:
    """Whether ``value`` names the mesh's device (ops take a device as a top-level argument)."""
    return isinstance(value, torch.device) and value.type == MESH_DEVICE


#: The most ranks an estimate takes (a process group's size is a 32-bit integer; an estimate's
#: time grows with the ranks, about 35 s for 10,000 on a small model).
MAX_RANKS = 2**20


def check_world_size(world_size: object) -> int:
    """``world_size`` as a positive int up to :data:`MAX_RANKS`, or FsdpError saying what would be
    right."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise FsdpError(f"--fsdp takes a number of ranks, a positive integer; got {world_size!r}")
    if world_size > MAX_RANKS:
        raise FsdpError(f"--fsdp takes at most {MAX_RANKS} ranks; got {world_size}")
    return world_size


def sharded_device(device: str, world_size: object, reshard: bool, notes: list[str]) -> str:
    """``meta``, where a per-rank estimate runs, with a note that every number is one rank's;
    FsdpError for a world size, device or ``reshard`` setting the estimate cannot honour."""
    if world_size is None:
        raise FsdpError("--no-reshard applies to sharded runs: add --fsdp N or drop --no-reshard")
    ranks = check_world_size(world_size)
    if device not in ("auto", "meta"):
        raise _not_on(device)
    after = "resharded (FSDP2's default)" if reshard else "kept gathered (--no-reshard)"
    notes.append(
        f"one rank of {ranks} under FSDP2 (fully_shard on a fake process group, on meta): "
        f"every number is per rank; blocks {after} after forward"
    )
    return "meta"


def check_job_device(device: str, world_size: object) -> None:
    """FsdpError unless a sharded job runs on meta (an estimate) or on cpu inside a running
    process group (real ranks, as the validation test runs them)."""
    import torch.distributed as dist

    check_world_size(world_size)
    if device != "meta" and not (device == MESH_DEVICE and dist.is_initialized()):
        raise _not_on(device)


def _not_on(device: str) -> FsdpError:
    return FsdpError(
        f"--fsdp estimates one rank of N on meta, which --device {device} cannot: "
        "use --device meta (or auto)"
    )


@contextlib.contextmanager
def world(world_size: int, device: str = "meta") -> Iterator[World]:
    """On meta, a fake process group of ``world_size`` ranks, destroyed on exit (an estimate);
    on cpu, the running process group (real ranks), which must have ``world_size`` ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    check_job_device(device, world_size)
    running = dist.get_world_size() if dist.is_initialized() else None
    if device == "meta" and running is not None:
        raise FsdpError(
            "--fsdp estimates in a process of its own, but this one runs a process group: "
            "estimate outside the training job (memsave profile or fit)"
        )
    if device != "meta":
        if running != world_size:
            raise FsdpError(
                f"a process group of {running} ranks is running; cannot shard over {world_size}"
            )
        yield World(world_size, init_device_mesh(MESH_DEVICE, (world_size,)), estimate=False)
        return
    # Importing ``fake_pg`` registers the "fake" backend; its ``FakeStore`` moved into C++ after
    # torch 2.11 and is re-exported here in every version.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield World(world_size, init_device_mesh(MESH_DEVICE, (world_size,)), estimate=True)
    finally:
        dist.destroy_process_group()


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one, outermost first: a Hugging Face model's blocks (the
    classes its ``_no_split_modules`` names), else the members of every outermost
    ``nn.Sequential`` or ``nn.ModuleList`` that hold parameters (a ResNet's bottlenecks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    units: list[nn.Module] = []
    _collect_units(model, units)
    return units


def _collect_units(module: nn.Module, units: list[nn.Module]) -> None:
    for child in module.children():
        if isinstance(child, nn.Sequential | nn.ModuleList):
            units.extend(m for m in child.children() if any(True for _ in m.parameters()))
        else:
            _collect_units(child, units)

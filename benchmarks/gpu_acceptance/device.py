"""What the run ran on: versions, the device, and the device's memory as NVML sees it."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.reproduce.record import environment
from memsave_cli.kernels import nodes


def describe_device(device: str, build: bool = True) -> dict[str, Any]:
    """Versions and commit (``record.environment``), plus the device's name, capability and
    memory, CUDA, cuDNN and driver versions on cuda. Never raises: a field it cannot read says
    why. ``build`` false: the C++ nodes are not built for their status."""
    info: dict[str, Any] = {**environment(), "device": device, "cuda_version": torch.version.cuda}
    # Which path memsave's convolutions take (NOTE [why a drop-in is a C++ node]); building the
    # nodes here also spares every worker the compile.
    info["nodes"] = nodes.status() if build else "not built (the run was stopped first)"
    if device != "cuda":
        return info
    try:
        properties = torch.cuda.get_device_properties(0)
        info.update(
            name=properties.name,
            capability=f"{properties.major}.{properties.minor}",
            total_bytes=properties.total_memory,
            cudnn=torch.backends.cudnn.version(),
        )
    except Exception as error:
        info["name"] = f"unreadable: {error}"
    info.update(nvml_device_view())
    return info


def nvml_device_view() -> dict[str, Any]:
    """Driver version and the first device's memory (total, used by every process) from NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as error:
        return {"nvml": f"unavailable: {error}"}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
            "nvml_total_bytes": memory.total,
            "nvml_used_bytes": memory.used,
        }
    except Exception as error:
        return {"nvml": f"unreadable: {error}"}
    finally:
        pynvml.nvmlShutdown()

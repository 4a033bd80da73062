"""Device and dtype selection for cpu, cuda and npu (Ascend, through torch_npu)."""
from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


class DeviceUnavailable(RuntimeError):
    """The requested accelerator cannot be used here; the message says why and what to do."""


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")  # registers the "npu" device with torch
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve_device(name: str) -> torch.device:
    """auto picks cuda, then npu, then cpu. An explicit accelerator that is missing is an error, not a fallback."""
    if name not in DEVICE_CHOICES:
        raise DeviceUnavailable(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable("--device cuda: CUDA is not available (no GPU visible, or a CPU-only torch build)")
    if name == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise DeviceUnavailable(
                "--device npu: the torch_npu package is not installed; install the torch-npu build that "
                "matches your torch and CANN versions"
            ) from exc
        if not torch.npu.is_available():
            raise DeviceUnavailable("--device npu: torch_npu is installed but no Ascend NPU is visible")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    """How a worker names its device in GetLimits: type and index ("cpu", "cuda:0", "npu:1"); an accelerator chosen
    without an index (``--device cuda``) is named by the one torch uses for it, its current device."""
    if device.type == "cpu" or device.index is not None:
        return str(device)
    return f"{device.type}:{getattr(torch, device.type).current_device()}"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on accelerators (the checkpoint's dtype), float32 on cpu where bf16 matmuls are slow."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)

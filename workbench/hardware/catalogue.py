"""Devices the estimator plans for: memory, peak FLOP/s and the MFU a training run usually reaches.

GPU peaks are the dense bf16/fp16 tensor-core figures of GPU_PEAK_FLOPS (one table for both, and the one
runs report MFU against); the CPU's memory is this machine's RAM and its peak is measured lazily by the
matmul probe of workbench.hardware.probes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from workbench.base.errors import WorkbenchError
from workbench.base.units import GiB, parse_bytes
from workbench.hardware.precision import cpu_half
from workbench.hardware.probes import matmul_peak, once

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, matched on the device name.
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}
# Model FLOPs utilisation assumed for throughput predictions: 0.4 is what well-tuned LoRA and full
# fine-tuning reach on recent GPUs (0.3-0.5 is common). The CPU figure is what runs of
# builtin:smollm2-135m reached against the bf16 matmul probe on a 2-core machine (docs/estimator.md).
GPU_MFU = 0.4
CPU_MFU = 0.12


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cuda" or "cpu"
    memory: int  # bytes usable by one training process (the whole RAM for "cpu")
    peak_flops: float | None  # dense 16-bit FLOP/s; None: measured when first asked (cpu)
    mfu: float
    bf16: bool = True  # T4 and V100 have no bf16 tensor cores

    def peak(self, dtype: str = "bfloat16") -> float:
        if self.peak_flops is not None:
            return self.peak_flops
        import torch

        return peak_flops("cpu", dtype, torch.get_num_threads())[0]

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "memory_bytes": self.memory,
                "peak_flops": self.peak_flops, "mfu": self.mfu}


_GPU_KEYS: dict[str, str] = {}  # preset name -> key of GPU_PEAK_FLOPS (matched in device names)


def _gpu(name: str, gib: float, flops_key: str, bf16: bool = True) -> Device:
    _GPU_KEYS[name] = flops_key
    return Device(name, "cuda", int(gib * GiB), GPU_PEAK_FLOPS[flops_key], GPU_MFU, bf16)


PRESETS: dict[str, Device] = {d.name: d for d in (
    _gpu("h100", 80, "H100"),
    _gpu("h200", 141, "H200"),
    _gpu("a100-40gb", 40, "A100"),
    _gpu("a100-80gb", 80, "A100"),
    _gpu("l4", 24, "L4"),
    _gpu("l40s", 48, "L40S"),
    _gpu("a10g", 24, "A10G"),
    _gpu("rtx4090", 24, "RTX 4090"),
    _gpu("rtx3090", 24, "RTX 3090"),
    _gpu("t4", 16, "T4", bf16=False),
    _gpu("v100-16gb", 16, "V100", bf16=False),
    _gpu("v100-32gb", 32, "V100", bf16=False),
)}
ALIASES = {"a100": "a100-80gb", "v100": "v100-16gb", "4090": "rtx4090", "3090": "rtx3090", "h100-80gb": "h100"}
def cpu_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect() -> Device:
    """The device a run here would use: the first CUDA GPU (matched to a preset), else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return get_device("cpu")
    name = torch.cuda.get_device_name()
    memory = torch.cuda.get_device_properties(0).total_memory
    # the longest key that names this card ("L40S" before "L4"), then the preset closest in memory
    flops_key = max((k for k in GPU_PEAK_FLOPS if k in name.upper()), key=len, default=None)
    matches = [PRESETS[p] for p, k in _GPU_KEYS.items() if k == flops_key]
    if not matches:
        return Device(name, "cuda", memory, GPU_PEAK_FLOPS.get(flops_key), GPU_MFU)
    preset = min(matches, key=lambda d: abs(d.memory - memory))
    return Device(preset.name, "cuda", memory, preset.peak_flops, GPU_MFU, preset.bf16)


def get_device(name: str | None = None, memory: int | str | None = None) -> Device:
    """A preset by name ("h100", "a100-40gb", "cpu", ...), this machine's device when name is None;
    `memory` overrides the preset's memory (e.g. a MIG slice or a card with less usable memory)."""
    if name is None:
        device = detect()
    elif name.lower() == "cpu":
        device = Device("cpu", "cpu", cpu_memory(), None, CPU_MFU)
    else:
        key = ALIASES.get(name.lower(), name.lower())
        if key not in PRESETS:
            raise WorkbenchError(f"device: unknown device '{name}' (known: cpu, {', '.join(PRESETS)})")
        device = PRESETS[key]
    if memory is not None:
        device = Device(device.name, device.kind, parse_bytes(memory), device.peak_flops, device.mfu, device.bf16)
    return device


@once
def peak_flops(device_type: str, dtype_name: str, threads: int) -> tuple[float, str]:
    """(peak FLOP/s, where it came from): a data-sheet figure on known GPUs, else a matmul probe."""
    import torch

    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops, f"datasheet:{key}"
    size = peak_probe_size(device_type, getattr(torch, dtype_name))
    return matmul_peak(device_type, dtype_name, threads, size), f"probe:{dtype_name}:{threads}threads"


def peak_probe_size(device_type: str, dtype) -> int:
    """The matmul size a peak probe times: 1024, or 256 for a half type this CPU has no native kernel for
    (bf16 on AVX2), where a 1024 matmul alone takes seconds."""
    import torch

    if device_type == "cpu" and dtype != torch.float32 and cpu_half().half is None:
        return 256
    return 1024

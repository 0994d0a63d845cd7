"""What a run measures: real tokens/s, peak memory, model FLOPs and MFU, and the JSONL metric log."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch


def full_numel(param) -> int:
    """Values a parameter stands for: 4-bit weights store packed values, and ZeRO-3 loads
    parameters already partitioned (an empty local tensor with the full size in ds_numel)."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None:
        return int(torch.Size(quant_state.shape).numel())
    return int(getattr(param, "ds_numel", param.numel()))


def finite_json(value):
    """NaN and infinities become null: they are not JSON, and other readers refuse them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def matmul_flops(model) -> int:
    """Weights that take part in a matmul per token: every Linear (LoRA factors and lm_head included)."""
    total = 0
    for module in model.modules():
        # PEFT wrappers expose their base layer's weight as their own: count the base layer once
        if isinstance(module, torch.nn.Embedding) or hasattr(module, "base_layer"):
            continue
        weight = getattr(module, "weight", None)
        shape = getattr(weight, "ds_shape", getattr(weight, "shape", ()))  # ZeRO-3 keeps the full shape aside
        if isinstance(weight, torch.Tensor) and len(shape) == 2 and "Linear" in type(module).__name__:
            total += full_numel(weight)
    return total


class FlopCounter:
    """Model FLOPs of training steps (no recomputation counted: that makes it MFU, not HFU).

    Per token: forward 2·W, backward through the activations 2·W, weight gradients 2·T
    (W = matmul weights, T = trainable matmul weights; full fine-tuning gives the usual 6·W).
    Attention adds 12·layers·width per attended position (QKᵀ and AV, forward and backward),
    counted from the real, causal, per-sample positions of each batch.
    """

    def __init__(self, model, config):
        self.weights = matmul_flops(model)
        trainable = sum(full_numel(p) for p in model.parameters()
                        if p.requires_grad and len(getattr(p, "ds_shape", p.shape)) == 2)
        self.trainable = min(trainable, self.weights)
        layers = getattr(config, "num_hidden_layers", 0)
        heads = getattr(config, "num_attention_heads", 0) or 1
        head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
        width = heads * head_dim
        self.attention_per_position = 12 * layers * width

    def step_flops(self, tokens: int, attended_positions: int, extra_forwards: int = 0) -> float:
        """extra_forwards: forward passes without gradients beside the one with (the reference of DPO and KTO,
        KTO's KL samples: TrainingSection.extra_forwards)."""
        flops = (4 * self.weights + 2 * self.trainable) * tokens + self.attention_per_position * attended_positions
        flops += extra_forwards * (2 * self.weights * tokens + self.attention_per_position / 3 * attended_positions)
        return float(flops)


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows the interrupted run wrote after the checkpoint it resumes from."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [json.dumps(row) for row in read_metrics(self.path) if row.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(finite_json(row), allow_nan=False) + "\n")
            handle.flush()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run
        if isinstance(row, dict):  # a hand-edited file may hold anything else
            rows.append(row)
    return rows

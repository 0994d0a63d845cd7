"""A model split for tensor parallel: transformers splits each layer its `tp_plan` names into DTensor slices as it
loads (colwise: q, k, v, gate and up by output rows; rowwise: o and down by input columns), and peft places each
LoRA factor with its base slice (a colwise base: A whole on every process, B split by rows; a rowwise base: A
split by columns, B whole). Nothing here splits or communicates by hand."""

from __future__ import annotations

import torch


def load_options(tp_size: int) -> dict:
    """from_pretrained's arguments that split the model over `tp_size` processes (none for one)."""
    if tp_size <= 1:
        return {}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=tp_size)}


def global_lora_features(model) -> int:
    """peft 0.21 sizes a LoRA factor on a split base from the local slice (`in_features` of o_proj's A is its
    columns on this process), where transformers' tensor-parallel styles read `in_features`/`out_features` as the
    whole layer's when they reshape its input or output: training then fails inside the first rowwise layer
    ("shape '[64, 8]' is invalid"). The factors' own DTensor shapes are the whole ones: the Linear's sizes are
    set from them. Returns how many were set (tests/test_tensor_parallel.py sees when peft does it itself)."""
    from torch.distributed.tensor import DTensor

    changed = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and isinstance(module.weight, DTensor) and (
                ".lora_A." in f"{name}." or ".lora_B." in f"{name}."):
            out_features, in_features = module.weight.shape
            if (module.in_features, module.out_features) != (in_features, out_features):
                module.in_features, module.out_features = in_features, out_features
                changed += 1
    return changed


def whole_tensors(state: dict) -> dict:
    """A state dict with every DTensor slice gathered whole (a collective: every process calls it)."""
    from torch.distributed.tensor import DTensor

    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}

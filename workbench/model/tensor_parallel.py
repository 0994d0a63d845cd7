"""A model split for tensor parallel: transformers splits each layer its `tp_plan` names into DTensor slices as it
loads (colwise: q, k, v, gate and up by output rows; rowwise: o and down by input columns), and peft places each
LoRA factor with its base slice (a colwise base: A whole on every process, B split by rows; a rowwise base: A
split by columns, B whole). Nothing here splits or communicates by hand."""

from __future__ import annotations

import torch

from workbench.base.errors import RecipeError


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


def check_targets(model) -> None:
    """Every LoRA layer sits on a linear layer the tensor-parallel plan split: an embedding's LoRA factors are drawn
    apart from the linear ones' (the draws repeated for one process would shift), and a layer outside the plan
    (the LM head) meets split inputs it was not written for. RecipeError naming the field otherwise."""
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.lora.model import get_tp_plan_and_mesh

    base_model = model.get_base_model()
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        # the plan's style for this layer, as peft reads it to place the factors (it places colwise and rowwise)
        style, _ = get_tp_plan_and_mesh(base_model, name.removeprefix("base_model.model."))
        if module.lora_embedding_A or style not in ("colwise", "rowwise"):
            leaf = name.rsplit(".", 1)[-1]
            raise RecipeError(f"adapter.target_modules: {leaf} is not one of the linear layers tensor parallel "
                              "splits (the decoder layers' projections); target those (e.g. all-linear), or use "
                              "strategy fsdp")


def whole_tensors(state: dict) -> dict:
    """A state dict with every DTensor slice gathered whole (a collective: every process calls it)."""
    from torch.distributed.tensor import DTensor

    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}


def is_split(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def lora_layers(model) -> list:
    """The LoRA layers in the order peft created (and initialised) them: the model's module order."""
    from peft.tuners.lora.layer import LoraLayer

    return [module for _, module in model.named_modules() if isinstance(module, LoraLayer) and module.lora_A]


def draw_as_one_process(model, drawn_from: torch.Tensor, init) -> None:
    """The LoRA factors one process would have drawn: peft initialises each factor of a split layer on its slice
    (another size, so other numbers from the random stream, and A's bound from the slice's fan-in), so the same
    recipe would start from another adapter than on one process. Here peft's draws are repeated on the whole
    shapes, from the random state peft started from and in its order (nn.Linear's own draws for A and B, then
    A's initialisation), and each process keeps its slice; the random state is left where one process's would
    be. tests/test_tensor_parallel.py checks the repetition against peft's own draws in one process."""
    import math

    from torch.distributed.tensor import DTensor, distribute_tensor

    if init not in (True, "gaussian"):
        raise ValueError(f"LoRA init {init!r} is not repeated for tensor parallel")
    torch.set_rng_state(drawn_from)
    for layer in lora_layers(model):
        for name in layer.lora_A:
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            (rank, fan_in), (fan_out, _) = a.shape, b.shape  # DTensor shapes are the whole ones
            torch.nn.init.kaiming_uniform_(torch.empty(rank, fan_in), a=math.sqrt(5))  # nn.Linear(in, r)
            torch.nn.init.kaiming_uniform_(torch.empty(fan_out, rank), a=math.sqrt(5))  # nn.Linear(r, out)
            whole = torch.empty(rank, fan_in)
            if init is True:
                torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
            else:
                torch.nn.init.normal_(whole, std=1 / layer.r[name])
            with torch.no_grad():
                if isinstance(a, DTensor):
                    a.to_local().copy_(distribute_tensor(whole, a.device_mesh, a.placements).to_local())
                else:
                    a.copy_(whole)

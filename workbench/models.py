"""Load the tokenizer and base model a recipe names, quantize it if asked, and attach the adapter."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .builtin import is_builtin, resolve_builtin
from .errors import ModelError
from .recipe import AdapterSection, ModelSection, Recipe

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGET_MODULE_PRESETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}


def resolve_model_path(path: str) -> str:
    """A builtin name becomes its cached folder; a local folder stays; anything else is a hub id."""
    if is_builtin(path):
        return str(resolve_builtin(path))
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise ModelError(f"model.path: {local} has no config.json (not a transformers model folder)")
        return str(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ModelError(f"model.path: {path} does not exist (and is not a hub id of the form owner/name)")
    return path


def _hub_call(path: str, what: str, load):
    try:
        return load()
    except OSError as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = "the hub is offline (HF_HUB_OFFLINE=1)" if offline else "no network or no such repository"
        raise ModelError(f"model.path: cannot load the {what} of '{path}' from the hub: {hint} ({err})") from None


def load_tokenizer(model: ModelSection):
    from transformers import AutoTokenizer

    path = resolve_model_path(model.path)
    tokenizer = _hub_call(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(
        path, revision=model.revision, trust_remote_code=model.trust_remote_code))
    if tokenizer.pad_token is None:
        # Padding positions never carry loss, so reusing EOS as pad is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(model: ModelSection):
    from transformers import AutoConfig

    path = resolve_model_path(model.path)
    return _hub_call(path, "config", lambda: AutoConfig.from_pretrained(
        path, revision=model.revision, trust_remote_code=model.trust_remote_code))


def load_base_model(recipe: Recipe, device_map=None):
    """The frozen base model in the recipe's dtype (4/8-bit quantized for qlora)."""
    from transformers import AutoModelForCausalLM

    from .attention import AUTO, resolve
    from .precision import concrete

    recipe = concrete(recipe)
    path = resolve_model_path(recipe.model.path)
    attn = recipe.model.attn
    if attn == AUTO:  # a model loaded outside a run (chat, evaluate, merge): what a run here would use
        attn = resolve(recipe, _current_device().split(":")[0]).implementation
    kwargs = dict(
        dtype=DTYPES[recipe.model.dtype],
        attn_implementation=attn,
        revision=recipe.model.revision,
        trust_remote_code=recipe.model.trust_remote_code,
    )
    if recipe.quantization is not None:
        kwargs["quantization_config"] = bnb_config(recipe)
        from transformers.integrations import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():  # ZeRO-3 places (and partitions) the weights itself
            kwargs["device_map"] = device_map or {"": _current_device()}
    elif device_map is not None:
        kwargs["device_map"] = device_map
    return _hub_call(path, "weights", lambda: AutoModelForCausalLM.from_pretrained(path, **kwargs))


def bnb_config(recipe: Recipe):
    from transformers import BitsAndBytesConfig

    from .precision import concrete

    q = concrete(recipe).quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
        bnb_4bit_quant_storage=getattr(torch, q.quant_storage),
    )


def _current_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def target_modules(adapter: AdapterSection) -> str | list[str]:
    if isinstance(adapter.target_modules, list):
        return adapter.target_modules
    if adapter.target_modules == "all-linear":
        return "all-linear"
    return TARGET_MODULE_PRESETS[adapter.target_modules]


def attach_adapter(model, recipe: Recipe):
    """Wrap the base model for training: a PEFT adapter, or every weight trainable for `full`."""
    adapter = recipe.adapter
    if recipe.training.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs and needs no input-grad hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if adapter.method == "full":
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    if recipe.quantization is not None:
        prepare_quantized(model, recipe)
    config = LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=target_modules(adapter),
        use_rslora=adapter.rslora,
        use_dora=adapter.method == "dora",
        modules_to_save=adapter.modules_to_save,
        task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, config)
    except ValueError as err:
        raise ModelError(f"adapter.target_modules: {err}") from None
    # peft makes LoRA weights float32 but copies a modules_to_save module in the base's dtype: AdamW on 16-bit
    # weights loses small updates. Under autocast a float32 copy computes in 16 bit like the rest (without
    # it, a float32 copy between 16-bit layers could not run: pure 16-bit training stays as asked).
    from .precision import concrete

    if concrete(recipe).training.mixed_precision != "no":
        for param in model.parameters():
            if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.to(torch.float32)
    return model


def prepare_quantized(model, recipe: Recipe) -> None:
    """What a quantized base needs before its adapter: every weight frozen, and the weights left unquantized kept
    in the dtype precision.frozen_dtype_of chooses. peft's prepare_model_for_kbit_training would also cast them
    to float32: for a 128k vocabulary that is 2 GiB more for the embeddings and head of an 8B model, and the
    residual stream in float32 besides. (Non-reentrant gradient checkpointing, enabled above, needs no
    input-gradient hooks.)"""
    from .precision import concrete, frozen_dtype_of

    model.requires_grad_(False)
    if frozen_dtype_of(concrete(recipe)) != "float32":
        return  # as loaded (a model's own float32 modules, if any, stay float32)
    for param in model.parameters():  # 4-bit weights stored as bfloat16 (quant_storage) stay packed
        if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit":
            param.data = param.data.to(torch.float32)


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable) parameter counts of the whole model, whatever this process holds of it."""
    total = trainable = 0
    for param in model.parameters():
        n = full_numel(param)
        total += n
        if param.requires_grad:
            trainable += n
    return total, trainable


def full_numel(param) -> int:
    """Values a parameter stands for: 4-bit weights store packed values, and ZeRO-3 loads
    parameters already partitioned (an empty local tensor with the full size in ds_numel)."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None:
        return int(torch.Size(quant_state.shape).numel())
    return int(getattr(param, "ds_numel", param.numel()))

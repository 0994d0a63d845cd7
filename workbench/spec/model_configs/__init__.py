"""Shapes of models, known without downloading them.

The JSON files here are the published config.json of popular models, named after their hub id
(`meta-llama--Llama-3.1-8B.json` is `meta-llama/Llama-3.1-8B`), so the estimator works offline.
`describe_model` builds a model from its config on the meta device (no memory, no weights), so
parameter counts and module shapes are exact, and sums up what the estimator needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.base.builtin import is_builtin, resolve_builtin
from workbench.base.errors import ModelError, escaped
from workbench.base.hub_reach import check_hub_answers

if TYPE_CHECKING:
    from workbench.spec.recipe import AdapterSection, Recipe

CONFIG_DIR = Path(__file__).parent
# Instruction-tuned and base variants share the base model's shapes.
_VARIANT = re.compile(r"-(instruct|it|pt|base|chat)(?=-|$)")


def _key(hub_id: str) -> str:
    return _VARIANT.sub("", hub_id.lower().replace("meta-llama-3", "llama-3"))


def shipped_configs() -> dict[str, Path]:
    """{published hub id: config file} for every config shipped with the workbench."""
    return {p.stem.replace("--", "/", 1): p for p in sorted(CONFIG_DIR.glob("*.json"))}


def find_config(hub_id: str) -> Path | None:
    """The shipped config of a hub id, ignoring -Instruct/-it/-pt/-Base suffixes and case."""
    wanted = _key(hub_id)
    return next((p for name, p in shipped_configs().items() if _key(name) == wanted), None)


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int
    bias: bool
    in_layer: bool  # inside the first decoder layer (the layer every estimate per layer is based on)


@dataclass(frozen=True)
class ModelInfo:
    """What a model is made of. Counts are exact; shapes are those of a built model."""

    name: str
    source: str  # "builtin", "local folder", "shipped config" or "hub"
    params: int
    linears: tuple[Linear, ...]  # every nn.Linear, the output head included
    head: str | None  # name of the output projection (lm_head), never a LoRA target under all-linear
    embedding_params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layer_params: int  # parameters of one decoder layer
    layer_norms: tuple[tuple[str, int], ...]  # (name, width) of each norm in one decoder layer
    checkpoint_dtype: str  # dtype the weights are published in
    checkpoint_bytes: int | None  # size of the local weight files, when there are any
    context: int | None = None  # the longest sequence its positions cover (max_position_embeddings)
    flex_attention: bool = True  # whether its transformers class runs FlexAttention
    # loading reads the checkpoint a tensor at a time instead of mapping it (models.read_without_mapping)
    read_without_mapping: bool = False
    tied_embeddings: bool = False  # the head is the input embeddings' matrix (counted once in params)
    vocabulary_stored_dtype: str | None = None  # what the local files hold the embeddings in (their headers)

    @property
    def linear_params(self) -> int:
        return sum(lin.in_features * lin.out_features for lin in self.linears)

    @property
    def gated_mlp(self) -> bool:
        return any(lin.name.endswith(("gate_proj", "w1", "gate_up_proj")) for lin in self.linears)


def _load_config(path: str, revision: str | None, trust_remote_code: bool):
    from transformers import AutoConfig

    if is_builtin(path):
        return AutoConfig.from_pretrained(resolve_builtin(path)), "builtin", resolve_builtin(path)
    local = Path(path).expanduser()
    if local.is_dir() and (local / "config.json").exists():
        return AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code), "local folder", local
    if local.is_file() and local.suffix == ".json":
        return AutoConfig.from_pretrained(str(local)), "config file", None
    shipped = find_config(path)
    if shipped is not None:
        return AutoConfig.from_pretrained(str(shipped)), "shipped config", None
    check_hub_answers(path, "model", "model.path", ModelError)
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        known = ", ".join(shipped_configs())
        raise ModelError(f"model.path: no config for '{escaped(path)}' offline and the hub did not answer ({err}); "
                         f"shipped configs: {known}") from None
    return config, "hub", None


def checkpoint_files(folder: Path) -> list[Path] | None:
    """The safetensors files of a model folder, chosen as transformers chooses them (a single `model.safetensors`
    first, else the shards its index names); None if there are none. ModelError names an index that is not
    valid JSON, lacks its weight map, names a shard that is missing or one outside the folder."""
    import json

    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ModelError(f"model.path: {escaped(index)} is not a shard index ({type(err).__name__}: {err})") from None
    inside = folder.resolve()
    files = []
    for name in shards:
        file = (folder / str(name)).resolve()
        if not file.is_relative_to(inside):
            raise ModelError(f"model.path: {escaped(index)} names a shard outside the model folder: {escaped(name)}")
        if not file.is_file():
            raise ModelError(f"model.path: {escaped(index)} names a shard that is missing: {escaped(name)}")
        files.append(file)
    return files


def stored_vocabulary_dtype(files: list[Path] | None, vocab: int, hidden: int) -> str | None:
    """The dtype the checkpoint stores its (vocab x hidden) matrices in, read from the safetensors headers (the
    config's dtype can be missing or wrong); None without local files or such a tensor."""
    import json
    import struct

    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
    for file in files or []:
        try:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(min(length, 100 << 20)))
        except (OSError, ValueError, struct.error):
            raise ModelError(f"model.path: {escaped(file)} is not a readable safetensors file") from None
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict) and entry.get("shape") == [vocab, hidden]:
                return names.get(entry.get("dtype"))
    return None


@lru_cache(maxsize=32)
def describe_model(path: str, revision: str | None = None, trust_remote_code: bool = False) -> ModelInfo:
    """Build the model on the meta device and read its shapes (a second or less, even for 405B)."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source, folder = _load_config(path, revision, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    output = model.get_output_embeddings()
    head = next((n for n, m in model.named_modules() if m is output), None) if output is not None else None
    blocks = _decoder_layers(model, text.num_hidden_layers)
    in_first = {id(m) for m in blocks[0].modules()}
    linears = tuple(
        Linear(name, m.in_features, m.out_features, m.bias is not None, id(m) in in_first)
        for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    )
    norms = tuple((name, m.weight.numel()) for name, m in blocks[0].named_modules()
                  if "norm" in type(m).__name__.lower() and getattr(m, "weight", None) is not None)
    heads = text.num_attention_heads
    weight_files = [*folder.glob("*.safetensors"), *folder.glob("*.bin")] if folder else []
    files = checkpoint_files(folder) if folder else None
    return ModelInfo(
        name=path, source=source,
        params=sum(p.numel() for p in model.parameters()),
        linears=linears, head=head,
        embedding_params=sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)),
        layers=text.num_hidden_layers, hidden=text.hidden_size, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        vocab=text.vocab_size,
        layer_params=sum(p.numel() for p in blocks[0].parameters()),
        layer_norms=norms,
        checkpoint_dtype=str(getattr(config, "dtype", None) or getattr(text, "dtype", None) or "bfloat16")
        .replace("torch.", ""),
        checkpoint_bytes=sum(f.stat().st_size for f in weight_files) if weight_files else None,
        context=getattr(text, "max_position_embeddings", None),
        flex_attention=bool(getattr(type(model), "_supports_flex_attn", False)),
        read_without_mapping=bool(files and not trust_remote_code),
        tied_embeddings=output is not None and output.weight is model.get_input_embeddings().weight,
        vocabulary_stored_dtype=stored_vocabulary_dtype(files, text.vocab_size, text.hidden_size),
    )


def _decoder_layers(model, count: int):
    """The ModuleList of the language model's decoder layers (not a vision tower's)."""
    import torch

    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == count and name.endswith("layers")]
    if not lists:
        raise ModelError(f"cannot find the {count} decoder layers of {type(model).__name__}")
    lists.sort(key=lambda item: ("language_model" not in item[0], len(item[0])))
    return lists[0][1]


# -- which Linears an adapter wraps ----------------------------------------------------------------


TARGET_MODULE_PRESETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}


def target_modules(adapter: "AdapterSection") -> str | list[str]:
    """What peft's target_modules gets: the recipe's list, all-linear, or a preset's module names."""
    if isinstance(adapter.target_modules, list):
        return adapter.target_modules
    if adapter.target_modules == "all-linear":
        return "all-linear"
    return TARGET_MODULE_PRESETS[adapter.target_modules]


def lora_targets(recipe: Recipe, info: ModelInfo) -> list:
    """The Linear modules peft wraps: all-linear is every Linear but the output head (peft's rule)."""
    if recipe.adapter.method == "full":
        return []
    wanted = target_modules(recipe.adapter)
    if wanted == "all-linear":
        return [lin for lin in info.linears if lin.name != info.head]
    return [lin for lin in info.linears if named_in(lin.name, wanted)]


def named_in(name: str, wanted: list[str]) -> bool:
    """peft's matching of module names: the full name, or its last dotted components."""
    return any(name == w or name.endswith("." + w) for w in wanted)


def chunked_loss(recipe: Recipe, info: ModelInfo) -> bool:
    """Whether the loop's loss runs the head a chunk at a time (a plain head: no LoRA or trained copy on it).
    Under FSDP and ZeRO-3 the head is sharded and the full logits come back (see memory._strategy)."""
    if not recipe.training.fast_paths:
        return False
    if recipe.adapter.method == "full":  # the head stays a plain Linear, trained in place
        return True
    head = info.head or ""
    adapted = {lin.name for lin in lora_targets(recipe, info)}
    wrapped = head in adapted or named_in(head, recipe.adapter.modules_to_save or [])
    return not wrapped

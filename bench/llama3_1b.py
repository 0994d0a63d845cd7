"""A Llama-3-shaped model of 1.24B parameters (Llama 3.2 1B's shape: 128,256-word vocabulary, tied embeddings),
random weights, built offline and deterministically into the workbench cache: the memory benchmark's model for
the case QLoRA exists for, linear layers that dominate the weights.

    python bench/llama3_1b.py            # builds it once (about a minute, 2.5 GB in bf16) and prints its folder

Its tokenizer is builtin:tiny's (1,024 words): the unused rows of the 128k embedding cost what they cost in
a real Llama 3, which is what a memory benchmark needs. Its losses mean nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

VERSION = "bench-llama3-1b-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def path() -> Path:
    from workbench.base.builtin import built_once

    return built_once(VERSION, _build)


def shapes_only(folder: Path) -> Path:
    """The model's config and tokenizer without weights: what the estimator reads (the tests' planning input)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(_tokenizer(folder))
    config.dtype = "bfloat16"  # as _build stores the weights
    config.save_pretrained(folder)
    return folder


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    from workbench.base.builtin import resolve_builtin

    tiny = resolve_builtin("builtin:tiny")
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, folder / name)
    return AutoTokenizer.from_pretrained(folder)


def _config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _build(folder: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    tokenizer = _tokenizer(folder)
    config = _config(tokenizer)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    model.tie_weights()  # to_empty gave the head a storage of its own
    model = model.to(torch.bfloat16)  # as Llama 3 checkpoints are stored
    model.config.name_or_path = "bench/llama3-1b (random weights)"
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)


if __name__ == "__main__":
    print(path())

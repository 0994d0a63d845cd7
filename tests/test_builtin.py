import hashlib
import json

import pytest

from workbench import ModelError
from workbench.base.builtin import BUILT_RECORD, resolve_builtin
from workbench.model.loading import resolve_model_path


def digests(folder):
    """The model's files (not the record of their sizes, which a cache built by an earlier version lacks)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and p.name != BUILT_RECORD}


def test_tiny_is_built_deterministically_offline(tmp_path, monkeypatch, tiny_path):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path))
    rebuilt = resolve_builtin("builtin:tiny")
    assert rebuilt != tiny_path and digests(rebuilt) == digests(tiny_path)


def test_tiny_has_widths_for_4bit_a_chat_template_and_eos(tiny_path, tiny_tokenizer):
    config = json.loads((tiny_path / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "vocab_size"):
        assert config[key] % 64 == 0, key
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|pad|>"
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(tiny_tokenizer("any text, even ünïcödé")["input_ids"]) == "any text, even ünïcödé"


def test_model_paths_resolve_or_fail_clearly(tmp_path):
    with pytest.raises(ModelError, match="unknown builtin model 'builtin:huge'"):
        resolve_model_path("builtin:huge")
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_path("./missing/model")
    assert resolve_model_path("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"  # a hub id, tried later


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    from workbench.model.loading import load_tokenizer
    from workbench.spec.recipe import ModelSection

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="cannot load the tokenizer of 'nobody/no-such-model' from the hub"):
        load_tokenizer(ModelSection(path="nobody/no-such-model"))


@pytest.mark.slow
def test_smollm2_converts_from_the_wheel_gguf_to_a_plain_folder():
    from transformers import AutoConfig, AutoTokenizer

    folder = resolve_builtin("builtin:smollm2-135m")
    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576, 49152)
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and "SmolLM" in tokenizer.chat_template


@pytest.mark.parametrize("damage", ["config-a-folder", "tokenizer-gone", "weights-cut"])
def test_a_damaged_builtin_cache_is_one_line_naming_the_folder_to_delete(tmp_path, monkeypatch, damage):
    """The cache folder is an ordinary folder: a file gone, cut short or replaced by a folder loaded as a traceback
    deep in transformers (or as a hub lookup). The sizes recorded as it was built say it is damaged, and deleting
    the folder builds it again."""
    import os
    import shutil

    from workbench.base.builtin import resolve_builtin

    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path))
    folder = resolve_builtin("builtin:tiny")
    if damage == "config-a-folder":
        (folder / "config.json").unlink()
        (folder / "config.json").mkdir()
    elif damage == "tokenizer-gone":
        (folder / "tokenizer.json").unlink()
    else:
        weights = next(folder.glob("*.safetensors"))
        os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ModelError, match=rf"the cached builtin model {folder} is damaged .*; delete that folder"):
        resolve_builtin("builtin:tiny")
    shutil.rmtree(folder)
    assert resolve_builtin("builtin:tiny") == folder and (folder / "config.json").is_file()

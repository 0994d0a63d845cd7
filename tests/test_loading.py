"""Loading a local checkpoint a tensor at a time (models.read_without_mapping): the same weights as transformers'
own memory-mapped load, for single-file and sharded checkpoints, and the ordinary path where it cannot apply."""

import json

import torch
from transformers import AutoModelForCausalLM

from workbench import Recipe
from workbench.model_configs import checkpoint_files, describe_model
from workbench.models import load_base_model, read_without_mapping

from conftest import FP32, ROOT


def tiny_recipe_at(path, *extra):
    return Recipe.load(ROOT / "recipes/tiny.yaml").override(f"model.path={path}", *FP32, *extra)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_local_checkpoint_is_read_without_mapping_and_gives_the_same_model(tiny_bf16_path):
    recipe = tiny_recipe_at(tiny_bf16_path)
    read = read_without_mapping(str(tiny_bf16_path), recipe, {"dtype": torch.float32, "attn_implementation": "sdpa"})
    assert read is not None  # the path was taken
    mapped = AutoModelForCausalLM.from_pretrained(tiny_bf16_path, dtype=torch.float32)
    assert same_weights(read, mapped)
    assert read.name_or_path == str(tiny_bf16_path)  # what peft records as the adapter's base
    assert read.generation_config.eos_token_id == mapped.generation_config.eos_token_id
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        assert torch.equal(read(ids).logits, mapped(ids).logits)
    assert describe_model(str(tiny_bf16_path)).read_without_mapping  # the estimator knows


def test_a_sharded_checkpoint_is_read_shard_by_shard(tiny_bf16_path, tmp_path):
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_bf16_path, dtype=torch.bfloat16)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for item in tiny_bf16_path.iterdir():
        if item.name.startswith("tokenizer") or item.name in ("special_tokens_map.json", "chat_template.jinja"):
            (sharded / item.name).write_bytes(item.read_bytes())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = checkpoint_files(sharded)
    assert len(files) == len(set(index["weight_map"].values())) > 1
    loaded = load_base_model(tiny_recipe_at(sharded))
    assert same_weights(loaded, AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32))


def test_other_layouts_take_transformers_own_load(tiny_bf16_path, tmp_path):
    pickled = tmp_path / "pickled"  # a .bin checkpoint, as older repositories publish
    model = AutoModelForCausalLM.from_pretrained(tiny_bf16_path)
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    assert checkpoint_files(pickled) is None
    recipe = tiny_recipe_at(pickled)
    assert read_without_mapping(str(pickled), recipe, {"dtype": torch.float32}) is None
    assert load_base_model(recipe) is not None  # and it still loads
    remote = tiny_recipe_at(tiny_bf16_path, "model.trust_remote_code=true")
    assert read_without_mapping(str(tiny_bf16_path), remote, {"dtype": torch.float32}) is None

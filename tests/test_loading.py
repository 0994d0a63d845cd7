"""Loading a local checkpoint a tensor at a time (models.read_without_mapping): the same weights as transformers'
own memory-mapped load, for single-file and sharded checkpoints, and the ordinary path where it cannot apply."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from workbench import Recipe
from workbench.base.errors import ModelError
from workbench.model.loading import load_base_model, read_without_mapping
from workbench.spec.model_configs import checkpoint_files, describe_model

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


def test_a_single_file_wins_over_a_shard_index_as_in_transformers(tiny_bf16_path, tmp_path):
    both = tmp_path / "both"
    AutoModelForCausalLM.from_pretrained(tiny_bf16_path, dtype=torch.bfloat16).save_pretrained(both, max_shard_size="100KB")
    other = AutoModelForCausalLM.from_pretrained(tiny_bf16_path, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.save_pretrained(tmp_path / "single")
    (both / "model.safetensors").write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
    assert (both / "model.safetensors.index.json").exists()
    loaded = load_base_model(tiny_recipe_at(both))
    assert same_weights(loaded, AutoModelForCausalLM.from_pretrained(both, dtype=torch.float32))


@pytest.mark.parametrize("damage, message", [
    ("outside", "outside the model folder"),
    ("missing", "a shard that is missing"),
    ("not_json", "is not a shard index"),
    ("no_weight_map", "is not a shard index"),
    ("truncated", "is not a readable safetensors file"),
])
def test_a_damaged_checkpoint_is_named_not_a_traceback(tiny_bf16_path, tmp_path, damage, message):
    folder = tmp_path / "damaged"
    AutoModelForCausalLM.from_pretrained(tiny_bf16_path, dtype=torch.bfloat16).save_pretrained(
        folder, max_shard_size="100KB")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = sorted(set(data["weight_map"].values()))[0]
    if damage == "outside":
        (tmp_path / "elsewhere.safetensors").write_bytes((folder / shard).read_bytes())
        data["weight_map"] = {k: ("../elsewhere.safetensors" if v == shard else v) for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))
    elif damage == "missing":
        (folder / shard).unlink()
    elif damage == "not_json":
        index.write_text("{not json")
    elif damage == "no_weight_map":
        index.write_text(json.dumps({"metadata": {}}))
    else:
        (folder / shard).write_bytes((folder / shard).read_bytes()[:100])
    with pytest.raises(ModelError, match=message):
        load_base_model(tiny_recipe_at(folder))


def test_the_vocabulary_dtype_is_read_from_the_files_not_the_config(tiny_path, tmp_path):
    """A float32 checkpoint whose config says bfloat16 (or nothing) keeps a float32 vocabulary."""
    from workbench.model.loading import attach_adapter

    folder = tmp_path / "says-bf16"
    folder.mkdir()
    for item in tiny_path.iterdir():
        if item.is_file():
            (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    assert any(v == "float32" for k, v in config.items() if k in ("dtype", "torch_dtype"))
    config.update({k: "bfloat16" for k in ("dtype", "torch_dtype") if k in config})
    (folder / "config.json").write_text(json.dumps(config))
    info = describe_model(str(folder))
    assert info.checkpoint_dtype == "bfloat16" and info.vocabulary_stored_dtype == "float32"
    recipe = Recipe.load(ROOT / "recipes/tiny-qlora.yaml").override(
        f"model.path={folder}", *FP32, "quantization.compute_dtype=float32")
    model = attach_adapter(load_base_model(recipe), recipe)
    assert model.get_input_embeddings().weight.dtype == torch.float32


def test_an_embedding_that_scales_in_its_own_dtype_keeps_its_dtype(tiny_bf16_path):
    """Gemma's scaled embeddings multiply in the weight's dtype: a 16-bit copy would change their output."""
    from workbench.model.loading import keep_vocabulary_16bit

    class ScaledEmbedding(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * torch.tensor(33.94, dtype=self.weight.dtype)

    model = AutoModelForCausalLM.from_pretrained(tiny_bf16_path, dtype=torch.float32)
    plain = model.get_input_embeddings()
    scaled = ScaledEmbedding(plain.num_embeddings, plain.embedding_dim)
    scaled.weight = plain.weight
    model.set_input_embeddings(scaled)
    assert keep_vocabulary_16bit(model, torch.bfloat16) is False
    assert model.get_input_embeddings().weight.dtype == torch.float32

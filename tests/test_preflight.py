"""Preflight: a doomed run fails in seconds, before any weights load, naming what to fix."""

import shutil
from collections import namedtuple

import pytest
from transformers import AutoTokenizer, LlamaConfig

from workbench import RecipeError, WorkbenchError, train
from workbench.frontends.cli import main
from workbench.training.preflight import (check_context_length, check_disk_space, check_tokenizer, checkpoint_bytes,
                                          preflight)


def test_a_missing_data_file_is_named(tiny_recipe):
    with pytest.raises(RecipeError, match="data.eval: file nowhere/eval.jsonl not found"):
        preflight(tiny_recipe.override("data.eval=nowhere/eval.jsonl"))
    preflight(tiny_recipe.override("data.eval=owner/dataset"))  # a hub id is left to the loader


def test_a_data_folder_is_not_a_file(tiny_recipe):
    with pytest.raises(RecipeError, match="data.train: recipes/data is a folder"):
        preflight(tiny_recipe.override("data.train=recipes/data"))


def test_an_unwritable_output_folder_fails_before_training(tiny_recipe):
    # /proc takes no files, whoever runs the tests (permissions would not stop root)
    with pytest.raises(RecipeError, match="output.dir: cannot write in /proc"):
        preflight(tiny_recipe.override("output.dir=/proc/lora-workbench-test/run"))


def test_an_output_path_that_is_a_file_is_refused(tiny_recipe, tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(RecipeError, match="output.dir: .* exists and is not a folder"):
        preflight(tiny_recipe.override(f"output.dir={tmp_path}/taken"))


def test_too_little_disk_for_the_checkpoints_is_refused_before_loading(tiny_recipe, monkeypatch, tmp_path):
    recipe = tiny_recipe.override("output.save_every=5", "output.keep_last=3")
    one = checkpoint_bytes(38912)
    assert one == 38912 * 12  # the tiny model's LoRA weights and their two AdamW moments, in fp32
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - one, one))
    with pytest.raises(WorkbenchError, match=r"output.dir: .* 3 checkpoint\(s\) \+ one being written"):
        train(recipe, progress_bar=False)
    assert not (recipe.run_dir / "checkpoints").exists()  # stopped before the first step
    check_disk_space(recipe.override("output.save_every=null"), 38912)  # no checkpoints: no space needed


def test_chat_data_needs_a_chat_template(tiny_recipe, tiny_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    check_tokenizer(tiny_recipe, tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(RecipeError, match="data.format: chat needs a tokenizer with a chat template"):
        check_tokenizer(tiny_recipe, tokenizer)
    check_tokenizer(tiny_recipe.override("data.format=text"), tokenizer)


def test_a_tokenizer_without_eos_is_refused(tiny_recipe, tiny_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer.eos_token = None
    with pytest.raises(RecipeError, match="model.path: the tokenizer of builtin:tiny has no EOS token"):
        check_tokenizer(tiny_recipe, tokenizer)


def test_max_seq_len_beyond_the_model_limit_is_refused(tiny_recipe):
    config = LlamaConfig(max_position_embeddings=512)
    check_context_length(tiny_recipe, config)
    with pytest.raises(RecipeError, match="data.max_seq_len: 4096 is longer than builtin:tiny was trained for"):
        check_context_length(tiny_recipe.override("data.max_seq_len=4096"), config)


def test_validate_runs_the_preflight_on_request(tiny_recipe, capsys):
    path = tiny_recipe.run_dir.parent / "r.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tiny_recipe.override("data.train=missing.jsonl").save(path)
    assert main(["validate", str(path)]) == 0  # the schema alone is fine
    assert main(["validate", str(path), "--preflight"]) == 2
    assert "data.train: file missing.jsonl not found" in capsys.readouterr().err

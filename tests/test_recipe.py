from pathlib import Path

import pytest
import yaml

from workbench import Recipe, RecipeError
from workbench.frontends.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path, capsys):
    assert main(["validate", str(path)]) == 0
    assert "ok" in capsys.readouterr().out


def test_defaults_fill_every_section():
    recipe = Recipe()
    assert recipe.adapter.method == "lora" and recipe.adapter.r == 16
    assert recipe.training.micro_batch_size == 4 and recipe.distributed.strategy == "auto"
    assert recipe.run_dir == Path("runs/run")


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, expected", [
    ("training: {lrr: 0.1}", "training.lrr: unknown key 'lrr' (did you mean 'lr'?)"),
    ("adaptr: {r: 8}", "adaptr: unknown key 'adaptr' (did you mean 'adapter'?)"),
    ("distributed: {deepspeed: {stag: 3}}", "distributed.deepspeed.stag: unknown key 'stag' (did you mean 'stage'?)"),
    ("adapter: {method: lorax}", "adapter.method: Input should be 'lora', 'qlora', 'dora' or 'full', got 'lorax'"),
    ("adapter: {r: -1}", "adapter.r: Input should be greater than 0"),
    ("adapter: {target_modules: everything}", "adapter.target_modules: must be one of all-linear, attention, mlp"),
    ("training: {micro_batch_size: many}", "training.micro_batch_size: must be a whole number above 0, or auto; "
                                           "got 'many'"),
    ("training: {micro_batch_size: true}", "training.micro_batch_size: must be a whole number above 0, or auto; "
                                           "got true"),
    ("training: {micro_batch_size: auto}", "training: micro_batch_size auto splits training.batch_size"),
    ("training: {micro_batch_size: auto, batch_size: 8, grad_accum: 2}",
     "training: grad_accum 2 beside micro_batch_size auto, which chooses it"),
    ("training: {micro_batch_size: auto, batch_size: 1000000000000}",
     "training.batch_size: Input should be less than or equal to 1048576"),
    ("training: {micro_batch_size: 2, grad_accum: 2, batch_size: 8}",
     "training: batch_size 8 is not micro_batch_size x grad_accum (2 x 2 = 4)"),
    ("adapter: {method: lora}\nquantization: {bits: 4}", "quantization: only used with adapter.method: qlora"),
    # pydantic reads true as 1: a buffer of one row would shuffle nothing
    ("data: {streaming: true, shuffle_buffer: true}", "data.shuffle_buffer: must be a number, not true"),
    ("data: {limit: true}", "data.limit: must be a number, not true"),
    ("training: {lr: false}", "training.lr: must be a number, not false"),
])
def test_bad_recipes_name_the_field(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as err:
        Recipe.load(path)
    assert str(err.value).startswith(f"{path}: {expected}")


def test_invalid_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "name: x\ntraining:\n  lr: [1, 2\n")
    with pytest.raises(RecipeError, match=rf"{path}:\d+: invalid YAML"):
        Recipe.load(path)


def test_cli_reports_bad_recipe_on_one_line_with_exit_code_2(tmp_path, capsys):
    path = write(tmp_path, "training: {lrr: 0.1}")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {path}: training.lrr: unknown key 'lrr' (did you mean 'lr'?)"
    assert "Traceback" not in err


def test_overrides_are_parsed_as_yaml_values(tmp_path):
    recipe = Recipe.load(ROOT / "recipes/tiny.yaml", [
        "training.lr=1e-4", "adapter.r=32", "adapter.target_modules=[q_proj,v_proj]", "training.max_steps=null",
        "output.trackers=[tensorboard]", "name=other",
    ])
    assert recipe.training.lr == pytest.approx(1e-4) and recipe.adapter.r == 32
    assert recipe.adapter.target_modules == ["q_proj", "v_proj"]
    assert recipe.training.max_steps is None and recipe.output.trackers == ["tensorboard"]
    assert recipe.run_dir == Path("runs/other")


def test_python_override_keeps_the_original_and_validates():
    base = Recipe()
    changed = base.override("training.lr=0.5", adapter__r=4)
    assert (changed.training.lr, changed.adapter.r) == (0.5, 4)
    assert base.training.lr == 2e-4
    with pytest.raises(RecipeError, match="training.epochs: Input should be greater than 0"):
        base.override("training.epochs=0")
    with pytest.raises(RecipeError, match="expected key=value"):
        base.override("training.lr")
    with pytest.raises(RecipeError, match="name: is not a section"):
        base.override("name.x=1")


def test_show_prints_the_resolved_recipe_that_loads_back(tmp_path, capsys):
    assert main(["show", str(ROOT / "recipes/tiny.yaml"), "adapter.r=4"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["adapter"]["r"] == 4 and resolved["distributed"]["strategy"] == "auto"
    path = write(tmp_path, yaml.safe_dump(resolved))
    assert Recipe.load(path) == Recipe.load(ROOT / "recipes/tiny.yaml", ["adapter.r=4"])


def test_qlora_gets_default_4bit_quantization():
    recipe = Recipe.from_dict({"adapter": {"method": "qlora"}})
    assert recipe.quantization.bits == 4 and recipe.quantization.type == "nf4"


def test_keys_named_like_the_shapes_of_data_train_are_still_named():
    with pytest.raises(RecipeError, match=r"data.one: unknown key 'one'"):
        Recipe.load("recipes/tiny.yaml", ["data.one=1"])


@pytest.mark.parametrize("field", ["data.train", "data.chat_template"])
def test_cli_shows_escape_sequences_of_a_recipe_escaped(field, tmp_path, capsys):
    # a recipe from someone else: its values would retitle the terminal (OSC ... BEL), clear it, jump back over
    # the line (CR) and print a line of their own, were they printed raw
    hostile = "\x1b]0;pwned\x07\x1b[2J\rerror: fake line\x9b"
    recipe = yaml.safe_load((ROOT / "recipes/tiny.yaml").read_text())
    section, key = field.split(".")
    recipe[section][key] = str(tmp_path / f"missing{hostile}.jsonl")
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["validate", str(path), "--preflight"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}: ") and "pwned" in err  # the value is named ...
    assert not any(c in err for c in "\x1b\x07\r\x9b")  # ... but none of its control characters reach the terminal
    assert "missing\\x1b]0;pwned\\x07\\x1b[2J\\x0derror: fake line\\x9b" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("command, field", [(["validate"], "data.train"), (["validate"], "data.chat_template"),
                                            (["data"], "data.train")])
def test_a_line_break_in_a_file_name_stays_on_the_errors_one_line(command, field, tmp_path, capsys):
    recipe = yaml.safe_load((ROOT / "recipes/tiny.yaml").read_text())
    section, key = field.split(".")
    recipe[section][key] = str(tmp_path / "missing\nerror: fake line\r.jsonl")
    path = tmp_path / "named\nwith a break.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main([*command, str(path), *(["--preflight"] if command == ["validate"] else [])]) == 2
    err = capsys.readouterr().err
    assert "missing\\x0aerror: fake line\\x0d.jsonl" in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("command", [["merge", "RUN"], ["export", "RUN"], ["push", "RUN", "me/model"], ["stop", "RUN"],
                                     ["train", "RECIPE", "--resume"], ["data", "RECIPE"]])
def test_a_run_or_stream_named_with_a_line_break_stays_on_the_errors_one_line(command, tmp_path, capsys):
    """A folder or file the user names is quoted escaped in every command's one-line error (a run that is not
    there to merge, export, push, stop or resume; a stream's data file that is not there)."""
    named = tmp_path / "run\nerror: fake line"
    recipe = yaml.safe_load((ROOT / "recipes/tiny.yaml").read_text())
    recipe["output"]["dir"] = str(named)
    recipe["data"].update(train=str(named / "rows.jsonl"), streaming=True)
    recipe["training"]["max_steps"] = 2
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main([{"RUN": str(named), "RECIPE": str(path)}.get(a, a) for a in command]) != 0
    err = capsys.readouterr().err
    assert "run\\x0aerror: fake line" in err and len(err.splitlines()) == 1, err


def test_a_bad_row_of_a_file_named_with_a_line_break_is_one_line(tmp_path, capsys):
    data = tmp_path / "e\x1b[31mRED\n.jsonl"
    data.write_text('{"text": "a"}\nnot json\n')
    recipe = yaml.safe_load((ROOT / "recipes/tiny.yaml").read_text())
    recipe["data"]["train"] = str(data)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["data", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path}/e\\x1b[31mRED\\x0a.jsonl:2: invalid JSON (Expecting value)\n"


def test_a_recipe_file_named_with_a_line_break_keeps_one_problem_a_line(tmp_path, capsys):
    path = tmp_path / "named\nwith a break.yaml"
    path.write_text("training:\n  bogus: 1\nadapter:\n  bogus: 2\n")
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all("named\\x0awith a break.yaml: " in line for line in lines), lines

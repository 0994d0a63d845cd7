"""data.train as a list of sources: each read with its own format, weighted by a seeded choice that a resumed run
repeats exactly, held out for evaluation before weighting, shown in the preview and the model card; and bad input
is one line naming the source."""

import json
from pathlib import Path

import pytest
import torch

from run_files import resumed_from_its_checkpoint
from workbench import train
from workbench.base.errors import DataError
from workbench.data.prepared import mix_sources, tokenize_data
from workbench.frontends.cli import main
from workbench.model.loading import load_tokenizer
from workbench.spec.recipe import DataSource

CHAT = "recipes/data/tiny_chat.jsonl"


def alpaca_rows(path: Path, count: int) -> str:
    rows = [{"instruction": f"Spell the number {i}.", "input": "", "output": f"number {i}"} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_rows(path: Path, count: int) -> str:
    rows = [{"messages": [{"role": "user", "content": f"what is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def mixed(tiny_recipe, tmp_path, *, chat=CHAT, chat_weight=2, alpaca_weight=0.5, **data):
    sources = [{"path": chat, "weight": chat_weight},
               {"path": alpaca_rows(tmp_path / "alpaca.jsonl", 40), "format": "alpaca", "weight": alpaca_weight}]
    if data.get("eval_split"):
        data["eval"] = None  # the tiny recipe's eval file gives way to rows held out of each source
    return tiny_recipe.override(**{"data__train": sources, **{f"data__{k}": v for k, v in data.items()}})


def test_the_data_hashes_a_completed_run_is_checked_against_are_those_it_records(tiny_recipe, tmp_path):
    """`--resume auto` on a completed run hashes the files (streaming.content_hashes) without tokenizing them: the
    same hashes the run recorded, for one source and for a mix."""
    from workbench.data.prepared import chat_template_digest
    from workbench.data.streaming import content_hashes

    for recipe in (tiny_recipe.override(data__chat_template="chatml"), mixed(tiny_recipe, tmp_path)):
        tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
        data = tokenize_data(recipe.data, tokenizer, seed=1)
        hashes = content_hashes(recipe.data)
        assert hashes["train_sha256"] == data.train_fingerprint
        assert hashes["eval_sha256"] == data.eval_rows.fingerprint
        if recipe.data.chat_template:
            assert hashes["chat_template_sha256"] == chat_template_digest(tokenizer)


def test_each_source_is_weighted_and_rendered_with_its_own_format(tiny_recipe, tmp_path):
    recipe = mixed(tiny_recipe, tmp_path)
    tokenizer = load_tokenizer(recipe.model)
    data = tokenize_data(recipe.data, tokenizer, seed=1)
    assert [(p["rows"], p["samples"]) for p in data.mix] == [(200, 400), (40, 20)]
    assert len(data.train) == 420
    alone = tokenize_data(recipe.data.model_copy(update={"train": CHAT}), tokenizer, seed=1).train
    assert sorted(map(tuple, data.train["input_ids"][:400])) == sorted(2 * list(map(tuple, alone["input_ids"])))
    texts = [tokenizer.decode(ids) for ids in data.train["input_ids"][400:]]
    assert all("<|im_start|>user\nSpell the number" in t for t in texts)  # alpaca rows through the chat template
    assert len(set(texts)) == 20  # a half: twenty different rows, none twice


def test_the_choice_is_fixed_by_the_seed_and_counts_whole_repeats_first():
    import datasets

    part = datasets.Dataset.from_dict({"i": list(range(10))})
    source = DataSource(path="a.jsonl", format="chat", weight=2.5)
    (once,), (again,) = mix_sources([part], [source], seed=3), mix_sources([part], [source], seed=3)
    assert once["i"] == again["i"] and len(once) == 25
    counts = [once["i"].count(i) for i in range(10)]
    assert sorted(counts) == [2] * 5 + [3] * 5  # every row twice, five drawn a third time
    (other,) = mix_sources([part], [source], seed=4)
    assert other["i"] != once["i"]
    with pytest.raises(DataError, match=r"data.train\[0\].weight: 0.01 of the 10 rows of a.jsonl keeps none"):
        mix_sources([part], [source.model_copy(update={"weight": 0.01})], seed=3)


def test_rows_held_out_for_evaluation_never_reach_training(tiny_recipe, tmp_path):
    recipe = mixed(tiny_recipe, tmp_path, chat=chat_rows(tmp_path / "chat.jsonl", 200), eval_split=0.25)
    data = tokenize_data(recipe.data, load_tokenizer(recipe.model), seed=7)
    held = {tuple(ids) for ids in data.eval["input_ids"]}
    assert len(held) == len(data.eval) == 50 + 10  # a quarter of each source, before weighting
    assert not held & {tuple(ids) for ids in data.train["input_ids"]}
    assert [p["samples"] for p in data.mix] == [300, 15]


def test_one_source_reads_as_the_plain_file_did(tiny_recipe):
    tokenizer = load_tokenizer(tiny_recipe.model)
    plain = tokenize_data(tiny_recipe.data, tokenizer, seed=1)
    listed = tokenize_data(tiny_recipe.override(data__train=[CHAT]).data, tokenizer, seed=1)
    assert plain.train["input_ids"] == listed.train["input_ids"]
    assert plain.train_fingerprint == listed.train_fingerprint == plain.sources[0].rows.fingerprint


@pytest.mark.parametrize("value, message", [
    ("[{path: a.jsonl, weight: 0}]", r"data.train\[0\].weight: Input should be greater than 0"),
    ("[a.jsonl, {path: b.jsonl, weight: true}]", r"data.train\[1\].weight: .*expected a number such as 2 or 0.5"),
    ("[{path: a.jsonl, wieght: 2}]", r"data.train\[0\].wieght: unknown key 'wieght'"),
    ("[{weight: 2}]", r"data.train\[0\].path: Field required"),
    ("[]", r"data.train: an empty list of sources"),
    ("[{path: a.jsonl, format: preference}]", r"data.train\[0\].format: preference rows cannot mix with data.format "
                                              r"chat"),
    ("[{path: a.jsonl, format: poetry}]", r"data.train\[0\].format: Input should be"),
])
def test_a_bad_source_is_one_line_naming_it(tmp_path, capsys, value, message):
    run = tmp_path / "run"
    assert main(["train", "recipes/tiny.yaml", f"data.train={value}", f"output.dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and __import__("re").search(message, err[0]), err
    assert not run.exists()


def test_a_source_that_cannot_be_read_is_named(tiny_recipe, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n{"instruction": 3, "output": "y"}\n')
    recipe = tiny_recipe.override(data__train=[CHAT, {"path": str(bad), "format": "alpaca"}])
    with pytest.raises(DataError, match=rf"{bad}:2: field 'instruction' must be a string"):
        tokenize_data(recipe.data, load_tokenizer(recipe.model))


def test_the_preview_shows_the_mix_and_rows_of_each_source(tiny_recipe, tmp_path):
    from workbench.outputs.preview import preview_data

    preview = preview_data(mixed(tiny_recipe, tmp_path), rows=2)
    lines = preview.summary_lines()
    assert preview.source == f"{CHAT} + {tmp_path}/alpaca.jsonl" and preview.format == "chat+alpaca"
    assert f"  {CHAT} (chat): 200 rows, weight 2 -> 400 samples (95% of the mix)" in lines
    assert f"  {tmp_path}/alpaca.jsonl (alpaca): 40 rows, weight 0.5 -> 20 samples (5% of the mix)" in lines
    assert [where.rsplit(":", 1)[0] for where, _ in preview.rows] == [CHAT, CHAT, *[f"{tmp_path}/alpaca.jsonl"] * 2]


def test_the_estimator_counts_each_source_times_its_weight(tiny_recipe, tmp_path):
    from workbench.estimator.memory import data_tokens

    one = data_tokens(tiny_recipe)
    recipe = mixed(tiny_recipe, tmp_path, alpaca_weight=1)
    alpaca = data_tokens(tiny_recipe.override(data__train=str(tmp_path / "alpaca.jsonl")))
    assert data_tokens(recipe) == 2 * one + alpaca


@pytest.mark.slow
def test_a_mixed_run_resumes_exactly_and_evaluates_each_source(tiny_recipe, tmp_path):
    from workbench.outputs.evaluation import evaluate

    recipe = mixed(tiny_recipe, tmp_path, eval_split=0.1).override("training.max_steps=4", "output.save_every=2")
    done = train(recipe, progress_bar=False)
    assert [p["samples"] for p in done.summary["mix"]] == [360, 18]
    whole, again = resumed_from_its_checkpoint(done, recipe, last_step=4)
    assert all(torch.equal(whole[k], again[k]) for k in whole)  # the same rows in the same order after the resume
    card = (done.run_dir / "adapter" / "README.md").read_text()
    assert f"| train (alpaca, weight 0.5) | `{tmp_path}/alpaca.jsonl` | 18 |" in card
    result = evaluate(done.run_dir, max_new_tokens=4, save=False)
    assert result["rows"] == 20 + 4 and result["format"] == "chat+alpaca"  # a tenth of each source, held out


def test_one_weighted_source_is_a_mix_and_its_weight_is_in_the_fingerprint(tiny_recipe):
    tokenizer = load_tokenizer(tiny_recipe.model)
    plain = tokenize_data(tiny_recipe.data, tokenizer, seed=1)
    doubled = tokenize_data(tiny_recipe.override(data__train=[{"path": CHAT, "weight": 2}]).data, tokenizer, seed=1)
    assert doubled.mixed and not plain.mixed
    assert len(doubled.train) == 2 * len(plain.train)
    assert doubled.train_fingerprint != plain.train_fingerprint  # a resume with another weight is refused


def test_the_mix_counts_rows_after_data_limit(tiny_recipe, tmp_path):
    recipe = mixed(tiny_recipe, tmp_path, limit=30)
    data = tokenize_data(recipe.data, load_tokenizer(recipe.model), seed=1)
    assert [(p["rows"], p["samples"]) for p in data.mix] == [(30, 60), (30, 15)]


def test_a_source_that_truncation_empties_is_refused_by_name(tiny_recipe, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"instruction": "word " * 400, "input": "", "output": "yes"}) + "\n"
                            for _ in range(4)))
    recipe = tiny_recipe.override(data__train=[CHAT, {"path": str(long), "format": "alpaca"}])
    with pytest.raises(DataError, match=rf"data.train\[1\] \({long}\): no sample keeps a target token"):
        tokenize_data(recipe.data, load_tokenizer(recipe.model))


def test_evaluate_limit_takes_rows_of_every_source_in_turn():
    import datasets

    from workbench.data.rows import Rows
    from workbench.outputs.evaluation import _each_row

    def part(name, count):
        rows = Rows(datasets.Dataset.from_dict({"i": list(range(count))}), name, lambda k: f"{name}:{k + 1}", name)
        return rows, name

    taken = [(where, cfg) for _, where, cfg in _each_row([part("a", 3), part("b", 1)], limit=3)]
    assert taken == [("a:1", "a"), ("b:1", "b"), ("a:2", "a")]
    assert len(list(_each_row([part("a", 3), part("b", 1)], limit=None))) == 4


def test_a_data_error_leaves_no_empty_run_directory(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "not a list"}\n')
    run = tmp_path / "runs" / "bad-data"
    assert main(["train", "recipes/tiny.yaml", f"data.train={bad}", f"output.dir={run}", "--no-progress"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert not run.exists() and (tmp_path / "runs").is_dir()

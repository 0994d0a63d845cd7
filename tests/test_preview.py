"""The data preview (workbench/outputs/preview.py): the rows as training tokenizes them, their trained tokens, token
lengths, truncation and packing, through the API, the command line and the UI's handler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench as wb
from workbench.data.prepared import prepare_data
from workbench.data.rows import load_rows
from workbench.data.tokens import IGNORE, tokenize_row
from workbench.model.loading import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def tiny(*overrides):
    return wb.Recipe.load(ROOT / "recipes/tiny.yaml").override(*overrides)


def test_the_first_rows_are_what_training_tokenizes_with_the_trained_tokens_marked():
    recipe = tiny("data.max_seq_len=32")
    preview = wb.preview_data(recipe, rows=4)
    tokenizer = load_tokenizer(recipe.model)
    rows = load_rows(recipe.data.train)
    assert [where for where, _ in preview.rows] == [rows.where(i) for i in range(4)]
    for i, (_, (sample,)) in enumerate(preview.rows):
        example = tokenize_row(rows.dataset[i], tokenizer, recipe.data, rows.where(i))
        assert "".join(text for text, _ in sample.spans) == tokenizer.decode(example["input_ids"])
        trained = "".join(text for text, kept in sample.spans if kept)
        assert trained == tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"])
                                            if label != IGNORE])
        assert (sample.tokens, sample.targets, sample.truncated) == (len(example["input_ids"]), example["targets"],
                                                                     example["truncated"])
    assert "<|im_start|>user" in preview.rows[0][1][0].spans[0][0] and not preview.rows[0][1][0].spans[0][1]


@pytest.mark.parametrize("packing", [True, False])
def test_lengths_truncation_and_packing_agree_with_the_prepared_data(packing):
    recipe = tiny("data.max_seq_len=32", f"data.packing={str(packing).lower()}")
    preview = wb.preview_data(recipe, rows=0)
    prepared = prepare_data(recipe.data, load_tokenizer(recipe.model))
    stats = preview.stats
    assert preview.rows == [] and len(preview.lengths) == stats["rows"] == prepared.stats["train_samples"] == 200
    assert max(preview.lengths) <= 32 and stats["max_length"] == max(preview.lengths)
    assert stats["tokens"] == prepared.stats["train_tokens"] == sum(preview.lengths)
    assert stats["truncated"] == prepared.stats["train_truncated"] > 0
    assert stats["lost_answer"] == prepared.stats["train_empty"] > 0
    assert stats["examples"] == prepared.stats["train_samples"] - prepared.stats["train_empty"]
    if packing:
        assert stats["packed_rows"] == len(prepared.train)
        kept = stats["tokens"] - sum(n for n, t in zip(preview.lengths, _targets(recipe)) if t == 0)
        assert stats["packing_efficiency"] == pytest.approx(kept / (len(prepared.train) * 32))
        assert 0.5 < stats["packing_efficiency"] <= 1
    else:
        assert stats["packed_rows"] is None and "packing off" in preview.to_text()
    figure = preview.histogram()
    assert figure.axes[0].get_xlabel().startswith("tokens per sequence")


def _targets(recipe):
    tokenizer = load_tokenizer(recipe.model)
    rows = load_rows(recipe.data.train)
    return [tokenize_row(rows.dataset[i], tokenizer, recipe.data, "")["targets"] for i in range(len(rows.dataset))]


def test_a_preference_pair_shows_both_answers_and_counts_two_sequences():
    preview = wb.preview_data(wb.Recipe.load(ROOT / "recipes/tiny-dpo.yaml"), rows=1)
    (_, (chosen, rejected)), = preview.rows
    assert (chosen.label, rejected.label) == ("chosen", "rejected")
    assert chosen.spans[0] == rejected.spans[0] and not chosen.spans[0][1]  # the same masked prompt
    assert chosen.spans[1][1] and rejected.spans[1][1] and chosen.spans[1] != rejected.spans[1]
    assert len(preview.lengths) == 2 * preview.stats["rows"]
    assert max(preview.lengths) <= preview.max_seq_len


def test_rows_from_a_file_are_escaped_in_html(tmp_path):
    data = tmp_path / "hostile.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "<script>alert(1)</script>"},
                                             {"role": "assistant", "content": "<img src=x onerror=alert(2)>"}]})
                    + "\n")
    preview = wb.preview_data(tiny(f"data.train={data}", "data.eval=null"), rows=1)
    page = preview.to_html()
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page and "&lt;img" in page


def test_a_bad_row_is_named_with_its_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    '{"text": 3}\n')
    with pytest.raises(wb.DataError, match=r"bad.jsonl:2"):
        wb.preview_data(tiny(f"data.train={data}", "data.eval=null"))


def test_the_command_prints_text_json_and_a_histogram(tmp_path, capsys):
    from workbench.frontends.cli import main

    command = ["data", "recipes/tiny.yaml", "data.max_seq_len=32", "--rows", "1"]
    assert main(command + ["--histogram", str(tmp_path / "lengths.png")]) == 0
    printed = capsys.readouterr().out
    assert "200 rows (chat)" in printed and "truncated at max_seq_len: 186" in printed
    assert "⟦" in printed and "⟧" in printed  # not a terminal: trained spans marked in text
    assert (tmp_path / "lengths.png").stat().st_size > 1000
    assert main(command + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["stats"]["rows"] == 200 and len(printed["lengths"]) == 200 and len(printed["rows"]) == 1
    assert main(command[:-2] + ["--rows", "-1"]) == 2
    assert "--rows: must be 0 or more" in capsys.readouterr().err


def test_the_ui_previews_only_inside_the_workspace_and_bounds_the_rows(tmp_path, monkeypatch):
    """The UI runs `workbench data` like a job, in the workspace as its working folder: a relative path means
    the same file to the check and to the reader, wherever the server was started from."""
    pytest.importorskip("gradio")
    import os
    import shutil

    from ui.handlers import Handlers

    root = tmp_path / "ws"
    shutil.copytree(ROOT / "recipes", root / "recipes")
    (tmp_path / "recipes/data").mkdir(parents=True)  # the same relative path outside the workspace
    (tmp_path / "recipes/data/tiny_chat.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "SECRET"}, {"role": "assistant", "content": "x"}]}))
    monkeypatch.chdir(tmp_path)
    h = Handlers(root)
    text = (root / "recipes/tiny.yaml").read_text()
    status, rows, figure = h.preview_data(text, 2)
    assert "200 rows (chat)" in status and rows.count('class="wb-sample"') == 2 and 'class="wb-trained"' in rows
    assert "SECRET" not in rows and figure.axes[0].get_xlabel().startswith("tokens per sequence")
    assert not any((root / ".workbench-ui/previews").iterdir())  # the recipe copy is removed
    outside = tmp_path / "outside.jsonl"
    outside.write_text((ROOT / "recipes/data/tiny_chat.jsonl").read_text())
    called = []
    status, rows, _ = h.preview_data(text.replace("recipes/data/tiny_chat.jsonl", str(outside)), 2,
                                     runner=lambda *a: called.append(a))
    assert "error" in status and "outside the workspace" in status and rows == "" and not called
    for bad in (10_000, -1, 2.5, float("inf"), float("nan"), "abc", True, [1]):
        status, rows, _ = h.preview_data(text, bad, runner=lambda *a: called.append(a))
        assert "rows to show: a whole number from 0 to 20" in status, (bad, status)
    assert not called
    os.mkfifo(root / "recipes/data/pipe.jsonl")
    status, rows, _ = h.preview_data(text.replace("recipes/data/tiny_chat.jsonl", "recipes/data/pipe.jsonl"), 1)
    assert "not a regular file" in status and rows == ""


def test_a_data_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(wb.DataError, match="pipe.jsonl: not a regular file"):
        wb.preview_data(tiny(f"data.train={tmp_path / 'pipe.jsonl'}", "data.eval=null"))


def test_a_chat_template_that_refuses_a_row_is_named_with_its_line(tmp_path):
    from workbench.base.builtin import resolve_builtin

    model = tmp_path / "model"
    import shutil

    shutil.copytree(resolve_builtin("builtin:tiny"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
              "{% endif %}{{ m['content'] }}{% endfor %}")
    config["chat_template"] = strict
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "yo"}])) + "\n")
    with pytest.raises(wb.DataError, match=r"rows.jsonl:2: the tokenizer's chat template refuses this row: no system"):
        wb.preview_data(tiny(f"model.path={model}", f"data.train={data}", "data.eval=null"))


def test_the_preview_reads_what_training_reads(tmp_path):
    """data.limit bounds the rows shown too; data.eval_split holds out what training holds out; data training
    would refuse is refused."""
    preview = wb.preview_data(tiny("data.limit=2"), rows=5)
    assert len(preview.rows) == 2 and preview.stats["rows"] == 2
    split = wb.preview_data(tiny("data.eval=null", "data.eval_split=0.25"), rows=0)
    prepared = prepare_data(tiny("data.eval=null", "data.eval_split=0.25").data,
                            load_tokenizer(tiny().model), seed=tiny().training.seed)
    assert split.stats["rows"] == prepared.stats["train_samples"] == 150 and split.stats["eval_rows"] == 50
    assert split.stats["packed_rows"] == len(prepared.train) and "held out for evaluation" in split.to_text()
    with pytest.raises(wb.DataError, match="every sample loses its whole answer"):
        wb.preview_data(tiny("data.max_seq_len=8"))


def test_a_pair_that_training_leaves_out_says_so_and_each_side_has_its_own_truncation():
    recipe = wb.Recipe.load(ROOT / "recipes/tiny-dpo.yaml").override("data.max_seq_len=48")
    preview = wb.preview_data(recipe, rows=60)
    sides = [pair for _, pair in preview.rows]
    assert any(chosen.truncated != rejected.truncated for chosen, rejected in sides)
    assert all(s.tokens == 48 for pair in sides for s in pair if s.truncated)
    left = [pair for pair in sides if pair[0].left_out]
    assert left and all(pair[1].left_out for pair in left) and "(left out of training)" in preview.to_text()
    assert all(not (c.left_out or r.left_out) for c, r in sides if c.targets and r.targets and c.spans != r.spans)


def test_control_characters_of_the_data_never_reach_the_terminal(tmp_path, capsys):
    from workbench.frontends.cli import main

    data = tmp_path / "esc.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "\x1b[2J\x1b]0;title\x07 hi"},
                                             {"role": "assistant", "content": "ok"}]}) + "\n")
    assert main(["data", "recipes/tiny.yaml", f"data.train={data}", "data.eval=null", "--rows", "1"]) == 0
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "\x07" not in printed and "\\x1b[2J" in printed
    assert main(["data", "recipes/tiny.yaml", "--histogram", str(tmp_path)]) == 2
    assert "--histogram: a .png, .svg, .pdf or .jpg file" in capsys.readouterr().err


def test_rows_must_be_a_whole_number_and_a_mapping_is_a_recipe():
    for bad in (-1, 2.5, "3", None, True):
        with pytest.raises(wb.RecipeError, match="rows: a whole number"):
            wb.preview_data(tiny(), rows=bad)
    assert wb.preview_data(tiny().to_dict(), rows=1).stats["rows"] == 200

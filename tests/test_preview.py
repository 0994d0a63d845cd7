"""The data preview (workbench/preview.py): the rows as training tokenizes them, their trained tokens, token
lengths, truncation and packing, through the API, the command line and the UI's handler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.data import IGNORE, load_rows, prepare_data, tokenize_row
from workbench.models import load_tokenizer

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


def test_the_command_prints_text_json_and_a_histogram(tmp_path):
    command = [sys.executable, "-m", "workbench", "data", "recipes/tiny.yaml", "data.max_seq_len=32", "--rows", "1"]
    done = subprocess.run(command + ["--histogram", str(tmp_path / "lengths.png")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "200 rows (chat)" in done.stdout and "truncated at max_seq_len: " in done.stdout
    assert "⟦" in done.stdout and "⟧" in done.stdout  # not a terminal: trained spans marked in text
    assert (tmp_path / "lengths.png").stat().st_size > 1000
    done = subprocess.run(command + ["--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    printed = json.loads(done.stdout)
    assert printed["stats"]["rows"] == 200 and len(printed["lengths"]) == 200 and len(printed["rows"]) == 1
    done = subprocess.run(command[:-2] + ["--rows", "-1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "--rows: must be 0 or more" in done.stderr


def test_the_ui_previews_only_inside_the_workspace_and_bounds_the_rows(tmp_path):
    pytest.importorskip("gradio")
    import shutil

    from ui.handlers import Handlers

    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    h = Handlers(tmp_path)
    text = (tmp_path / "recipes/tiny.yaml").read_text()
    status, rows, figure = h.preview_data(text, 2)
    assert "200 rows (chat)" in status and rows.count('class="wb-sample"') == 2 and 'class="wb-trained"' in rows
    assert figure.axes[0].get_xlabel().startswith("tokens per sequence")
    outside = tmp_path.parent / "outside.jsonl"
    outside.write_text((ROOT / "recipes/data/tiny_chat.jsonl").read_text())
    called = []
    status, rows, _ = h.preview_data(text.replace("recipes/data/tiny_chat.jsonl", str(outside)), 2,
                                     previewer=lambda *a, **k: called.append(a))
    assert "error" in status and "outside" in status.lower() and rows == "" and not called
    status, rows, _ = h.preview_data(text, 10_000, previewer=lambda *a, **k: called.append(a))
    assert "rows to show: between 0 and 20" in status and not called

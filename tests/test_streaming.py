"""data.streaming: the training set read as a stream. An epoch holds every trainable sample once, packed within the
row length; the same epoch reads the same rows every time (so a resumed run is the uninterrupted one, bit for bit);
the processes are dealt the rows as a map-style epoch deals them; and what a stream cannot do, or a bad row met
mid-run, is one line naming the field or the file's line, keeping the checkpoints written before it."""

import json
import re

import pytest
import torch

from run_files import resumed_from_its_checkpoint
from workbench import train
from workbench.base.errors import DataError
from workbench.data import streaming
from workbench.data.batches import STAND_IN, Collator, sample_starts
from workbench.data.prepared import prepare_data, tokenize_data
from workbench.data.streaming import StreamBatches, StreamedExamples
from workbench.frontends.cli import main
from workbench.model.loading import load_tokenizer
from workbench.rundir.runs import RunDir

STREAMED = ("data.streaming=true", "training.max_steps=4")


def samples_of(rows: list[dict]) -> list[tuple]:
    """The samples packed in training rows, split where positions restart."""
    samples = []
    for row in rows:
        starts = sample_starts(torch.tensor(row["position_ids"])).nonzero().flatten().tolist() + [len(row["input_ids"])]
        samples += [tuple(row["input_ids"][a:b]) for a, b in zip(starts, starts[1:])]
    return sorted(samples)


@pytest.fixture
def small_windows(monkeypatch):
    """Packing windows far smaller than the source, so that an epoch crosses several (and a small shuffle buffer:
    STREAMED_SMALL)."""
    monkeypatch.setattr(streaming, "PACK_WINDOW", 24)
    monkeypatch.setattr(streaming, "PACK_WINDOW_TOKENS", 700)  # or fewer samples, when they are long


STREAMED_SMALL = (*STREAMED, "data.shuffle_buffer=16")


@pytest.mark.parametrize("packing", [True, False])
def test_an_epoch_holds_every_trainable_sample_once_in_rows_within_the_length(tiny_recipe, small_windows, packing):
    recipe = tiny_recipe.override(*STREAMED_SMALL, f"data.packing={str(packing).lower()}")
    tokenizer = load_tokenizer(recipe.model)
    stream = StreamedExamples(recipe.data, tokenizer, seed=3)
    rows = list(stream.examples(0))
    mapped = tokenize_data(recipe.data, tokenizer).train
    assert samples_of(rows) == sorted(tuple(ids) for ids, t in zip(mapped["input_ids"], mapped["targets"]) if t > 0)
    assert all(len(row["input_ids"]) <= recipe.data.row_len for row in rows)
    assert stream.read == {"samples": 200, "empty": 0, "cut": 0}
    assert list(stream.examples(0)) == rows  # the same epoch again: the same rows in the same order
    assert list(stream.examples(1)) != rows and samples_of(list(stream.examples(1))) == samples_of(rows)
    if packing:  # windows of 700 tokens (5-6 rows of 128) each leave a row part-filled: 83 rows for the whole set's 75
        assert len(rows) <= 1.15 * len(prepare_data(recipe.data, tokenizer).train)


def test_one_window_packs_as_the_map_style_path_does(tiny_recipe):
    recipe = tiny_recipe.override(*STREAMED)
    tokenizer = load_tokenizer(recipe.model)
    rows = list(StreamedExamples(recipe.data, tokenizer, seed=0).examples(0))
    assert len(rows) == len(prepare_data(recipe.data, tokenizer).train)  # 200 rows: one window, the same bins


def test_processes_are_dealt_the_rows_as_a_map_style_epoch_deals_them(tiny_recipe, small_windows):
    recipe = tiny_recipe.override(*STREAMED_SMALL)
    stream = StreamedExamples(recipe.data, load_tokenizer(recipe.model), seed=0)
    rows = list(stream.examples(0))
    keep = lambda examples: examples  # noqa: E731  (collate: the rows as they are)
    micro, world = 3, 2
    dealt = [list(StreamBatches(stream, keep, micro, world, rank)) for rank in range(world)]
    assert len(dealt[0]) == len(dealt[1]) == -(-len(rows) // (micro * world))  # every process runs every pass
    interleaved = [row for pair in zip(*dealt) for batch in pair for row in batch if not row.get(STAND_IN)]
    assert interleaved == rows  # each row once, in the epoch's order
    # the last round's rows: process 1 has none when they fill at most process 0's micro-batch
    assert sum(row.get(STAND_IN, False) for batch in dealt[1] for row in batch) == (0 < len(rows) % 6 <= 3)
    later = StreamBatches(stream, keep, micro, world, 1)
    later.set_epoch(0, skip=2)
    assert list(later) == dealt[1][2:]  # a resumed run continues at its round
    collated = next(iter(StreamBatches(stream, Collator(0), micro)))
    assert collated["input_ids"].shape[0] == micro and collated["num_tokens"] == sum(len(r["input_ids"])
                                                                                      for r in rows[:micro])


@pytest.mark.slow
def test_a_streamed_run_resumes_exactly_across_an_epoch_end(tiny_recipe, tmp_path):
    # 200 rows pack into 75, 8 a step: an epoch is 10 steps, and the run resumes at step 8 to go past it
    recipe = tiny_recipe.override("data.streaming=true", "training.max_steps=12", "output.save_every=4")
    done = train(recipe, progress_bar=False)
    assert done.summary["streaming"] is True and done.summary["total_steps"] == 12
    whole, again = resumed_from_its_checkpoint(done, recipe, last_step=12)
    assert all(torch.equal(whole[k], again[k]) for k in whole)


@pytest.mark.parametrize("overrides, message", [
    (["training.max_steps=null"], r"^.*training\.max_steps: a streamed data set has no length"),
    (["data.train=[recipes/data/tiny_chat.jsonl, recipes/data/tiny_chat.jsonl]"], r"data\.train: data\.streaming "
                                                                                   r"reads one source"),
    (["data.eval=null", "data.eval_split=0.1"], r"data\.eval_split: holding a fraction out needs the whole source"),
    (["data.train=rows.json"], r"data\.train: rows\.json is one JSON document"),
    (["data.format=unpaired", "training.objective=kto"], r"data\.format: unpaired rows pair each answer"),
    (["adapter.init=eva"], r"adapter\.init: eva reads the training data before the first step"),
])
def test_what_a_stream_cannot_do_is_one_line_naming_the_field(tmp_path, capsys, overrides, message):
    run = tmp_path / "run"
    assert main(["train", "recipes/tiny.yaml", "data.streaming=true", "training.max_steps=3", *overrides,
                 f"output.dir={run}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not run.exists()


@pytest.mark.slow
def test_a_bad_row_met_mid_run_names_its_line_and_keeps_the_checkpoints(tmp_path, capsys, small_windows):
    rows = [json.loads(line) for line in open("recipes/data/tiny_chat.jsonl")]
    bad = tmp_path / "rows.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows[:150]) + '{"messages": "not a list"}\n')
    run = tmp_path / "run"
    code = main(["train", "recipes/tiny.yaml", *STREAMED_SMALL, f"data.train={bad}", "training.max_steps=30",
                 "output.save_every=2", "output.keep_last=5", "training.threads=1", f"output.dir={run}",
                 "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{bad}:151:" in err and "Traceback" not in err
    summary = RunDir(run).read_json()["summary"]
    assert summary["status"] == "failed" and f"{bad}:151" in summary["error"]
    latest = RunDir(run).latest_checkpoint()
    assert latest is not None and latest[0] >= 2  # the steps before the bad row were trained and kept


def test_a_stream_reads_csv_and_parquet_rows_naming_their_place(tiny_recipe, tmp_path):
    import pandas as pd

    rows = [{"instruction": f"Spell {i}.", "input": "", "output": f"number {i}"} for i in range(30)]
    pd.DataFrame(rows).to_csv(tmp_path / "rows.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet")
    tokenizer = load_tokenizer(tiny_recipe.model)
    read = {}
    for name in ("rows.csv", "rows.parquet"):
        recipe = tiny_recipe.override(*STREAMED, f"data.train={tmp_path / name}", "data.format=alpaca",
                                      "data.eval=null")
        read[name] = samples_of(list(StreamedExamples(recipe.data, tokenizer, seed=0).examples(0)))
    assert read["rows.csv"] == read["rows.parquet"] and len(read["rows.csv"]) == 30
    places = [item["where"] for item in streaming._read(str(tmp_path / "rows.csv"), "train", "alpaca")]
    assert places[0] == f"{tmp_path / 'rows.csv'}:2" and len(places) == 30  # the header is line 1


def test_the_preview_of_a_stream_reads_only_its_opening(tiny_recipe, tmp_path, monkeypatch):
    from workbench.outputs.preview import preview_data

    monkeypatch.setattr(streaming, "PREVIEW_ROWS", 50)
    rows = open("recipes/data/tiny_chat.jsonl").read().splitlines()
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(rows[:60]) + '\n{"messages": "not a list"}\n')  # past the opening: never read
    preview = preview_data(tiny_recipe.override(*STREAMED, f"data.train={source}"), rows=2)
    assert preview.stats["rows"] == 50 and preview.stats["streamed"]
    assert preview.summary_lines()[0].startswith(f"{source}: the first 50 rows (a stream: read as it trains)")
    assert [where for where, _ in preview.rows] == [f"{source}:1", f"{source}:2"]


@pytest.mark.slow
def test_two_processes_follow_one_on_a_stream_through_an_epoch_end(tmp_path):
    """9 rows unpacked, 4 a step: steps of 4, 4 and 1 rows, then the next epoch. On two processes of micro-batch 2
    the last round leaves process 1 without a row: it runs a stand-in, and the run is the one-process run's."""
    import socket

    import workbench as wb
    from run_files import adapter, assert_same_adapter
    from conftest import FP32

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recipe = wb.Recipe.load("recipes/tiny.yaml").override(
        f"output.dir={tmp_path}/{{name}}", "data.streaming=true", "data.packing=false", "data.limit=9",
        "training.max_steps=5", "training.grad_accum=1", "output.save_every=null", "output.eval_every=null",
        "output.log_every=1", "training.threads=1", *FP32)
    one = train(recipe.override("name=one", "training.micro_batch_size=4"), progress_bar=False)
    two = wb.launch(recipe.override("name=two", "training.micro_batch_size=2", "distributed.strategy=ddp"), nproc=2,
                    master=f"127.0.0.1:{port}", timeout=400)
    assert two.summary["status"] == "completed" and two.summary["world_size"] == 2
    loss = lambda run: run.metrics["loss"].dropna().tolist()  # noqa: E731
    assert len(loss(two)) == 5 and loss(two) == pytest.approx(loss(one), rel=1e-4)
    assert_same_adapter(adapter(two.run_dir), adapter(one.run_dir), atol=2e-5)


@pytest.mark.slow
def test_a_bad_opening_never_touches_an_earlier_run_it_would_replace(tiny_recipe, tmp_path, capsys):
    done = train(tiny_recipe.override(*STREAMED, "training.max_steps=2"), progress_bar=False)
    before = {p.relative_to(done.run_dir): p.read_bytes() for p in done.run_dir.rglob("*") if p.is_file()}
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"messages": "not a list"}\n')
    assert main(["train", "recipes/tiny.yaml", *STREAMED, f"data.train={bad}", f"output.dir={done.run_dir}",
                 "--overwrite", "--no-progress"]) == 2
    assert f"{bad}:1:" in capsys.readouterr().err
    after = {p.relative_to(done.run_dir): p.read_bytes() for p in done.run_dir.rglob("*") if p.is_file()}
    assert after == before  # the run it would have replaced, as it was
    fresh = tmp_path / "fresh"
    assert main(["train", "recipes/tiny.yaml", *STREAMED, f"data.train={bad}", f"output.dir={fresh}",
                 "--no-progress"]) == 2
    assert not fresh.exists()  # nor is a directory left behind that a corrected run would have to --overwrite


def test_the_first_bad_row_of_the_file_is_named_not_one_the_shuffle_met_first(tiny_recipe, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(40)))  # no `messages` anywhere
    recipe = tiny_recipe.override(*STREAMED, f"data.train={rows}")
    with pytest.raises(DataError, match=rf"^{rows}:1: "):
        StreamedExamples(recipe.data, load_tokenizer(recipe.model), seed=0).open()


@pytest.mark.parametrize("content, message", [
    ("instruction,output\nSpell 1.,one\n,two\n", r"rows\.csv:3: the cell in column 'instruction' is empty"),
    (b"instruction,output\nSpell 1.,one\nSpell \xff.,two\n", r"rows\.csv:3: not UTF-8 text \(byte 0xff"),
])
def test_a_streamed_csv_names_an_empty_cell_or_bytes_that_are_not_text(tiny_recipe, tmp_path, content, message):
    source = tmp_path / "rows.csv"
    source.write_bytes(content.encode() if isinstance(content, str) else content)
    recipe = tiny_recipe.override(*STREAMED, f"data.train={source}", "data.format=alpaca", "data.eval=null")
    with pytest.raises(DataError, match=message):
        list(StreamedExamples(recipe.data, load_tokenizer(recipe.model), seed=0).examples(0))


@pytest.mark.slow
def test_a_streamed_reward_run_warns_of_the_pairs_it_leaves_out(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "recipes/tiny-reward.yaml", *STREAMED, "training.max_steps=2", "data.max_seq_len=40",
                 "training.threads=1", f"output.dir={run}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    summary = RunDir(run).read_json()["summary"]
    assert summary["train_cut"] > 0 and summary["train_opening_rows"] > summary["train_cut"]
    assert (f"warning: {summary['train_cut']} training pair(s) (of the first {summary['train_opening_rows']} rows "
            "read) longer than data.max_seq_len=40 are left out") in out


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "x"}]}',
     "a string holds an unpaired surrogate escape"),
    ('{"messages": [], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
     "field 'messages' appears twice"),
])
def test_a_row_no_reader_takes_is_named_as_the_map_style_path_names_it(tiny_recipe, tmp_path, line, message):
    rows = open("recipes/data/tiny_chat.jsonl").read().splitlines()
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(rows[:5]) + "\n" + line + "\n")
    recipe = tiny_recipe.override(*STREAMED, f"data.train={source}")
    with pytest.raises(DataError, match=rf"^{source}:6: {message}"):
        list(StreamedExamples(recipe.data, load_tokenizer(recipe.model), seed=0).examples(0))
    with pytest.raises(DataError, match=rf"^{source}:6: {message}"):  # the same words as the map-style path's
        tokenize_data(recipe.data, load_tokenizer(recipe.model))


def test_a_preview_that_stops_at_an_opening_with_nothing_to_learn_says_so(tiny_recipe, tmp_path, monkeypatch):
    from workbench.outputs.preview import preview_data

    monkeypatch.setattr(streaming, "PREVIEW_ROWS", 20)
    long_answers = [{"messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y"}]}] * 20
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in long_answers)
                      + open("recipes/data/tiny_chat.jsonl").read())
    with pytest.raises(DataError, match=r"every sample loses its whole answer .* \(in the first 20 rows of the "
                                        r"stream, all a preview reads; a run reads on past them\)"):
        preview_data(tiny_recipe.override(*STREAMED, f"data.train={source}"))


def _rewritten_in_place(path) -> None:
    """Other rows in the same bytes' count and the same file (only its modification time tells)."""
    lines = path.read_text().splitlines()
    path.write_text("\n".join(reversed(lines)) + "\n")


def test_a_touched_source_reads_on_and_a_rewritten_one_is_refused_when_the_stream_opens_it(tiny_recipe, tmp_path):
    import os
    import shutil

    source = tmp_path / "rows.jsonl"
    shutil.copy("recipes/data/tiny_chat.jsonl", source)
    recipe = tiny_recipe.override(*STREAMED, f"data.train={source}")
    data = streaming.stream_data(recipe.data, load_tokenizer(recipe.model), seed=0)
    first = samples_of(list(data.train.examples(0)))
    os.utime(source, ns=(1, 1))  # its stamp moved, its bytes did not: hashed again, and read on
    assert samples_of(list(data.train.examples(1))) == first
    size = source.stat().st_size
    _rewritten_in_place(source)
    assert source.stat().st_size == size
    with pytest.raises(DataError, match=rf"^{re.escape(str(source))}: changed while the run reads it as a stream"):
        list(data.train.examples(2))
    source.unlink()
    with pytest.raises(DataError, match=rf"^{re.escape(str(source))}: removed while the run reads it"):
        list(data.train.examples(3))


def _numbered_rows(path, count: int, word: str = "plus", repeat: int = 1) -> None:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} {word} {i}?"},
                          {"role": "assistant", "content": f"{i} {word} {i} is {2 * i}. " * repeat}]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _stream_of(tiny_recipe, source, buffer: int):
    recipe = tiny_recipe.override(*STREAMED, f"data.train={source}", f"data.shuffle_buffer={buffer}")
    return streaming.stream_data(recipe.data, load_tokenizer(recipe.model), seed=0).train


def test_a_source_rewritten_mid_epoch_is_refused_within_a_window(tiny_recipe, tmp_path, small_windows):
    """Rows of the same length put in place mid-epoch (only the modification time tells): the stream stats the
    file as it reads and before each window trains, so the rewrite stops it a window later, not at the epoch's
    end (or never, for a run whose step budget ends first)."""
    source = tmp_path / "rows.jsonl"
    _numbered_rows(source, 2000)
    size = source.stat().st_size
    rows = _stream_of(tiny_recipe, source, 10).examples(0)
    for _ in range(30):
        next(rows)
    _numbered_rows(source, 2000, word="PLUS")
    assert source.stat().st_size == size
    after = 0
    with pytest.raises(DataError, match=rf"^{re.escape(str(source))}: changed while the run reads it as a stream"):
        for _ in rows:
            after += 1
    assert after < 100  # of some 1,000 rows left in the epoch


@pytest.mark.parametrize("buffer", [50, 1000])  # a stat between buffers, and a bad row met before the next one
def test_a_bad_row_in_a_source_rewritten_mid_epoch_is_reported_as_the_change(tiny_recipe, tmp_path, small_windows,
                                                                              buffer):
    """Other rows put in place: the reader, at its old offset, meets rows that fail their check (half a line, or
    rows of another shape). The row is not the fault; the rewrite is, and the message names it."""
    source = tmp_path / "rows.jsonl"
    _numbered_rows(source, 2000)
    rows = _stream_of(tiny_recipe, source, buffer).examples(0)
    for _ in range(30):
        next(rows)
    questions = [{"messages": [{"role": "user", "content": f"What is {i}?"}]} for i in range(2000)]  # no answers
    source.write_text("".join(json.dumps(r) + "\n" for r in questions))
    with pytest.raises(DataError, match=rf"^{re.escape(str(source))}: changed while the run reads it as a stream"):
        list(rows)


def test_a_source_rewritten_before_the_step_budget_ends_fails_the_run_naming_it(tmp_path, capsys, monkeypatch):
    """The whole source fits the shuffle buffer, so it is read (and checked) before the first step; rewritten
    while the steps train, the run ends before the stream reads the file again: the end of the run checks it."""
    import shutil

    source = tmp_path / "rows.jsonl"
    shutil.copy("recipes/data/tiny_chat.jsonl", source)
    batches = StreamBatches.__iter__

    def rewritten_after_a_batch(self):
        for number, batch in enumerate(batches(self)):
            if number == 1:
                _rewritten_in_place(source)
            yield batch

    monkeypatch.setattr(StreamBatches, "__iter__", rewritten_after_a_batch)
    run = tmp_path / "run"
    code = main(["train", "recipes/tiny.yaml", *STREAMED, f"data.train={source}", "training.threads=1",
                 "data.eval=null", "output.eval_every=null", f"output.dir={run}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == DataError.exit_code and f"{source}: changed while the run reads it as a stream" in err, err
    assert RunDir(run).read_json()["summary"]["status"] == "failed" and not (run / "adapter").exists()


@pytest.mark.slow
def test_a_source_rewritten_mid_run_stops_the_run_naming_it_before_an_epoch_reads_it(tmp_path, capsys, monkeypatch):
    """Rewritten while epoch 0 trains: epoch 1 would read other rows than those whose hash run.json records."""
    import shutil

    source = tmp_path / "rows.jsonl"
    shutil.copy("recipes/data/tiny_chat.jsonl", source)
    recorded = streaming.source_fingerprint(str(source), "train")
    examples = StreamedExamples.examples

    def rewritten_before_epoch_1(self, epoch):
        if epoch == 1:
            _rewritten_in_place(source)
        return examples(self, epoch)

    monkeypatch.setattr(StreamedExamples, "examples", rewritten_before_epoch_1)
    run = tmp_path / "run"
    # 200 rows pack into 75, 8 a step: an epoch is 10 steps
    code = main(["train", "recipes/tiny.yaml", *STREAMED, f"data.train={source}", "training.max_steps=14",
                 "output.save_every=5", "training.threads=1", f"output.dir={run}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == DataError.exit_code and f"{source}: changed while the run reads it as a stream" in err, err
    summary = RunDir(run).read_json()["summary"]
    assert summary["status"] == "failed" and summary["train_sha256"] == recorded
    assert RunDir(run).latest_checkpoint()[0] == 10  # epoch 0's steps were trained and kept

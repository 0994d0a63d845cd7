"""Training data read as a stream (`data.streaming: true`): for a source larger than memory or disk.

The map-style path (workbench/data/pipeline.py) copies the file, tokenizes every row into an Arrow cache and packs it
before the first step: memory stays flat, but the run waits for the whole file and needs its room on disk
several times over. A stream reads rows as training asks for them:

    rows (datasets' IterableDataset: a JSON lines file read line by line, CSV, Parquet or a hub data set streamed)
      -> shuffled in a seeded buffer of data.shuffle_buffer rows (another order each epoch)
      -> tokenized one by one, samples that lost their answer left out
      -> packed best-fit-decreasing within windows of PACK_WINDOW samples (PACK_WINDOW_TOKENS tokens at most), the
         window's rows in a seeded order
      -> dealt to the processes a micro-batch at a time, as StepBatches deals a map-style epoch

Every process reads the whole stream and keeps its own micro-batches, so a step holds the same samples on any
process count, and a resumed run reads the epoch again up to where it stopped: the same rows, the same
packing, exactly. Memory holds the two buffers, never the file; nothing is written to disk. The file is hashed
once, before the first row is read (the hash run.json records and a resume checks); each later opening of the
stream, each shuffle buffer's worth of rows read, each packing window before it trains, each end of the file and
the end of the run check with a stat that the file is still the one hashed (`check_unchanged`, hashing again only
when the stat moved), and a row that fails its check in a file that changed is reported as the change.

What a stream cannot know is its length: a streamed run needs training.max_steps (an epoch is one pass, and the
next epoch reads the source again in another order). What needs the whole source up front is refused by
`recipe_problem`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from pathlib import Path
from typing import Iterator

from workbench.base.errors import DataError, escaped
from workbench.base.hub_reach import check_hub_answers
from workbench.data.batches import STAND_IN
from workbench.data.prepared import (PreparedData, SourceData, TokenizedData, best_fit_decreasing,
                                     chat_template_digest, evaluation_examples, every_answer_truncated,
                                     every_example_cut, mix_fingerprint, row_check, tokenize_rows)
from workbench.data.rows import (LOCAL_FORMATS, Rows, check_utf8, csv_as_text, empty_cell, first_line, json_lines,
                                 json_row, load_rows, text_problem)
from workbench.data.tokens import check_row, tokenize_row
from workbench.spec.chat_templates import template_source
from workbench.spec.formats import format_of

PACK_WINDOW = 2_000  # samples binned together: within 1% of packing the whole set, on alpaca-like lengths
PACK_WINDOW_TOKENS = 2 ** 19  # or fewer, when they are long: a window's token lists stay near 50 MB
STREAMED_SUFFIXES = (".jsonl", ".csv", ".parquet")


# -- rows ---------------------------------------------------------------------------------------------------------


def _read(path: str, split: str, fmt: str) -> Iterator[dict]:
    """{"where", "row"} for each row of the source, in its own order, checked against its format: the first bad row
    of the file is the one named, before any shuffling (the generator datasets streams)."""
    for where, row in _rows(path, split, format_of(fmt).fields):
        check_row(row, fmt, where)
        yield {"where": where, "row": row}


def _rows(path: str, split: str, needs: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of the source; `needs`: the columns whose CSV cells may not be empty."""
    import datasets

    local = Path(path)
    builder = LOCAL_FORMATS.get(local.suffix.lower())
    try:
        if builder == "json":  # JSON lines, read here: every line is named, and no type is inferred
            for number, line in json_lines(local):
                row = json_row(local, number, line)
                problem = text_problem(line, row)
                if problem:
                    raise DataError(f"{escaped(path)}:{number}: {problem}")
                yield f"{escaped(path)}:{number}", row
            return
        if local.exists():
            rows = datasets.load_dataset(builder, data_files=str(local), split="train", streaming=True,
                                         **(csv_as_text(local) if builder == "csv" else {}))
            where = (lambda i: f"{escaped(path)}:{i + 2}") if builder == "csv" else (lambda i: f"{escaped(path)} record {i}")
        else:
            rows = datasets.load_dataset(path, split=split, streaming=True)
            where = lambda i: f"{escaped(path)}[{split}] row {i}"  # noqa: E731
        for i, row in enumerate(rows):
            if builder == "csv":
                empty = next((c for c in needs if c in row and row[c] in (None, "")), None)
                if empty is not None:
                    raise empty_cell(where(i), empty)
            yield where(i), row
    except DataError:
        raise
    except OSError as err:  # the file removed or unreadable while a run reads it
        raise DataError(f"{escaped(path)}: cannot read ({err.strerror or err})") from None
    except Exception as err:  # noqa: BLE001  pyarrow and datasets raise many types for a malformed source
        if builder == "csv":
            check_utf8(local)  # names the line of bytes that are not UTF-8
        raise DataError(f"{escaped(path)}: cannot read as a stream: {first_line(err)}") from None


def check_source(path: str) -> None:
    """DataError unless `path` is a local file a stream can read, or a hub data set name."""
    local = Path(path)
    if local.exists():
        if local.is_dir():
            raise DataError(f"{escaped(path)}: is a folder; give a {', '.join(STREAMED_SUFFIXES)} file")
        if not local.is_file():  # a FIFO or a device would block the reader, or never end
            raise DataError(f"{escaped(path)}: not a regular file; give a {', '.join(STREAMED_SUFFIXES)} file")
        if local.suffix.lower() not in STREAMED_SUFFIXES:
            raise DataError(f"{escaped(path)}: a stream reads {', '.join(STREAMED_SUFFIXES)} files (got '{local.suffix}')")
    elif path.count("/") != 1 or path.startswith((".", "/")):
        raise DataError(f"{escaped(path)}: no such file (and not a hub data set name of the form owner/name)")
    else:  # a hub that never answers: named in seconds, not after the libraries' retries
        check_hub_answers(path, "dataset", path, DataError)


def source_fingerprint(path: str, split: str) -> str:
    """The content hash of a local file, read a MB at a time (a resumed run refuses a changed file); a hub data
    set's name and split."""
    local = Path(path)
    if not local.exists():
        return f"hub:{path}:{split}"
    digest = hashlib.sha256()
    try:
        with local.open("rb") as source:
            for chunk in iter(lambda: source.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as err:
        raise DataError(f"{escaped(path)}: cannot read ({err.strerror or err})") from None
    return digest.hexdigest()


def content_hashes(cfg) -> dict[str, str]:
    """The content hashes a run records of its data (train_sha256, eval_sha256, chat_template_sha256), taken from
    the files as they are now, reading bytes only (no tokenizer, no tokenizing). A hub data set, and the tokenizer's
    own template, are left out: naming their content needs the download or the model."""
    hashes = {}
    sources = cfg.sources
    if all(Path(source.path).is_file() for source in sources):
        digests = [(source_fingerprint(source.path, cfg.split), source) for source in sources]
        mixed = len(sources) > 1 or sources[0].weight != 1
        hashes["train_sha256"] = mix_fingerprint(digests) if mixed else digests[0][0]
    if cfg.eval and Path(cfg.eval).is_file():
        hashes["eval_sha256"] = source_fingerprint(cfg.eval, cfg.split)
    if cfg.chat_template:
        hashes["chat_template_sha256"] = hashlib.sha256(template_source(cfg.chat_template)[0].encode()).hexdigest()
    return hashes


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What says, at the cost of one stat, that a local file is still the one that was hashed: its identity, size
    and modification time (None: not a local file, or none there any more)."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


# -- examples -----------------------------------------------------------------------------------------------------


class StreamedExamples:
    """One epoch's training examples, read, shuffled, tokenized and packed as they are asked for.

    `examples(epoch)` is the same sequence every time it is asked for the same epoch: the shuffle buffer, the
    packing windows and the order of each window's rows are all seeded."""

    def __init__(self, cfg, tokenizer, seed: int, share_prompts: bool = False, whole_only: bool = False):
        import datasets

        check_source(cfg.train)
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.share_prompts, self.whole_only = share_prompts, whole_only
        rows = datasets.IterableDataset.from_generator(_read, gen_kwargs={"path": cfg.train, "split": cfg.split,
                                                                         "fmt": cfg.format})
        if cfg.limit is not None:
            rows = rows.take(cfg.limit)
        self.rows = rows.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer)
        self.read = {"samples": 0, "empty": 0, "cut": 0}  # in the epoch being read
        self.primed: tuple[Iterator[dict], dict] | None = None
        self.hashed: tuple[tuple | None, str] | None = None  # (the file's stamp, its content hash): `fingerprint`

    def fingerprint(self) -> str:
        """data.train's content hash (source_fingerprint), which the run records; the file's stamp is kept with it,
        so that every later opening of the stream can tell, without hashing, that it reads those bytes."""
        before = _stamp(self.cfg.train)
        digest = source_fingerprint(self.cfg.train, self.cfg.split)
        if _stamp(self.cfg.train) != before:
            raise DataError(f"{escaped(self.cfg.train)}: changed while its content hash was taken; start the run again once "
                            "nothing writes to it")
        self.hashed = (before, digest)
        return digest

    def check_unchanged(self) -> None:
        """DataError unless data.train is still the file whose hash the run recorded. A stat each time the stream
        opens or finishes the file (never per row); the file is hashed again only when its stamp moved (a touch,
        a copy put back), and refused only when its bytes differ: an epoch read from other bytes would train on
        data that run.json and a resume's check do not know of."""
        if self.hashed is None or self.hashed[0] is None:  # not hashed here, or a hub data set
            return
        stamp, digest = self.hashed
        now = _stamp(self.cfg.train)
        if now == stamp:
            return
        if now is None:
            raise DataError(f"{escaped(self.cfg.train)}: removed while the run reads it as a stream; put it back as it was, "
                            "or start a new run")
        if source_fingerprint(self.cfg.train, self.cfg.split) != digest:
            raise DataError(f"{escaped(self.cfg.train)}: changed while the run reads it as a stream (its content hash "
                            "differs from the one the run recorded when it started); put the file back as it was, or "
                            "start a new run on the new data")
        self.hashed = (now, digest)

    def open(self) -> dict:
        """Read epoch 0 up to its first row (one shuffle buffer, one packing window), kept for the loop: a bad row
        there, or a source with nothing to learn, stops the run before it touches its directory. Returns what was
        read so far: samples, and those left out (no answer left, or cut for a reward model)."""
        if self.primed is None:
            rows = self._examples(0)
            self.primed = (rows, next(rows))
        return dict(self.read)

    def examples(self, epoch: int) -> Iterator[dict]:
        primed, self.primed = self.primed, None  # (a run resumed in a later epoch drops it)
        if epoch == 0 and primed is not None:
            return itertools.chain([primed[1]], primed[0])
        return self._examples(epoch)

    def _examples(self, epoch: int) -> Iterator[dict]:
        self.check_unchanged()  # the stream opens the file again (each epoch, and a resumed run's)
        self.rows.set_epoch(epoch)  # datasets reseeds the buffer with seed + epoch
        self.read = dict.fromkeys(self.read, 0)
        window: list[dict] = []
        windows = tokens = 0
        rows = self._checked_rows()
        while True:
            try:
                item = next(rows, None)
                if item is None:
                    break
                example = tokenize_row(item["row"], self.tokenizer, self.cfg, item["where"], self.share_prompts)
            except DataError:  # a bad row in a file that changed: the change is what to report (the row is only
                self.check_unchanged()  # where the reader met the new bytes)
                raise
            self.read["samples"] += 1
            if example["targets"] == 0:
                self.read["empty"] += 1
                continue
            if self.whole_only and example["truncated"]:  # a reward model reads whole samples
                self.read["cut"] += 1
                continue
            window.append(example)
            tokens += len(example["input_ids"])
            if len(window) == PACK_WINDOW or tokens >= PACK_WINDOW_TOKENS:
                # the window's rows were read from the bytes the run hashed, or none of them trains
                self.check_unchanged()
                yield from self._rows_of(window, epoch, windows)
                window, windows, tokens = [], windows + 1, 0
        self.check_unchanged()  # ... and has read it to its end
        if window:
            yield from self._rows_of(window, epoch, windows)
        elif not windows:  # nothing trainable in the whole source: what the map-style path refuses, refused alike
            if self.read["cut"]:
                raise every_example_cut(self.cfg)
            if self.read["empty"]:
                raise every_answer_truncated(self.cfg)
            raise DataError(f"{self.cfg.train_name}: no rows (the source is empty)")

    def _checked_rows(self) -> Iterator[dict]:
        """The shuffled rows, with a stat of the file each shuffle buffer's worth of rows read (a rewrite is caught
        within a buffer or so, a window before its rows train)."""
        for count, item in enumerate(self.rows, 1):
            if count % self.cfg.shuffle_buffer == 0:
                self.check_unchanged()
            yield item

    def _rows_of(self, window: list[dict], epoch: int, index: int) -> Iterator[dict]:
        """The window's samples as training rows: packed (each row's samples attend only to themselves), or one a
        row; in a seeded order, so that the rows binned first (the longest samples) do not always come first."""
        if self.cfg.packing:
            lengths = [e.get("whole_length", len(e["input_ids"])) for e in window]
            members, ends = best_fit_decreasing(lengths, self.cfg.row_len)
            members = members.tolist()
            rows = [_joined([window[i] for i in members[start:end]]) for start, end in zip([0, *ends[:-1]], ends)]
            random.Random(f"{self.seed}:{epoch}:{index}").shuffle(rows)
        else:
            rows = [_joined([example]) for example in window]
        yield from rows


def _joined(samples: list[dict]) -> dict:
    """Samples side by side in one row, each keeping its own positions (restarting at 0)."""
    row = {"input_ids": [], "labels": [], "position_ids": []}
    for sample in samples:
        row["input_ids"] += sample["input_ids"]
        row["labels"] += sample["labels"]
        row["position_ids"] += sample.get("position_ids") or list(range(len(sample["input_ids"])))
    return row


class StreamBatches:
    """This process's collated micro-batches of a streamed epoch, dealt as StepBatches deals a map-style one: the
    epoch's rows in rounds of micro_batch x world_size, process r taking the r-th micro-batch of each. The last
    round may be short: a process left without rows runs a stand-in (weighted by zero), so that every process
    runs the same passes. `set_epoch(epoch, skip)` starts at round `skip` (a resumed run: the rounds before are
    read and dropped)."""

    def __init__(self, examples: StreamedExamples, collate, micro_batch: int, world_size: int = 1, rank: int = 0):
        self.source, self.collate = examples, collate
        self.micro_batch, self.world_size, self.rank = micro_batch, world_size, rank
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        rows = self.source.examples(self.epoch)
        per_round = self.micro_batch * self.world_size
        for number in itertools.count():
            batch_round = list(itertools.islice(rows, per_round))
            if not batch_round:
                return
            if number < self.skip:
                continue
            mine = batch_round[self.rank * self.micro_batch:(self.rank + 1) * self.micro_batch]
            yield self.collate(mine or [{**batch_round[-1], STAND_IN: True}])


def stream_data(cfg, tokenizer, seed: int = 0, share_prompts: bool = False, whole_only: bool = False):
    """The streamed counterpart of data.prepare_data: the training examples as a stream, the held-out file
    (data.eval) prepared as usual, and the figures known before reading (content hashes)."""
    examples = StreamedExamples(cfg, tokenizer, seed, share_prompts, whole_only)
    fingerprint = examples.fingerprint()  # before the opening is read: every row read is of the bytes it hashed
    opening = examples.open()
    stats = {"streaming": True, "train_sha256": fingerprint,
             "chat_template_sha256": chat_template_digest(tokenizer),
             # what the first buffer showed: a stream counts what it leaves out as it reads
             "train_opening_rows": opening["samples"], "train_empty": opening["empty"]}
    if whole_only:
        stats["train_cut"] = opening["cut"]
    if format_of(cfg.format).sequences_per_example > 1:
        stats["shared_prompts"] = share_prompts
    evaluation = None
    if cfg.eval:
        eval_rows = load_rows(cfg.eval, cfg.split, row_check(cfg.format), format_of(cfg.format).fields)
        eval_tok, _ = tokenize_rows(eval_rows, tokenizer, cfg, share_prompts=share_prompts)
        stats["eval_sha256"] = eval_rows.fingerprint
        evaluation = evaluation_examples(eval_tok, cfg, whole_only, stats)
    return PreparedData(examples, evaluation, stats)


PREVIEW_ROWS = 1_000  # rows a preview of a stream reads: its figures are those of the source's opening


def opening(cfg, tokenizer, rows: int | None = None):
    """The first `rows` rows (PREVIEW_ROWS) of a streamed source, tokenized as training tokenizes them, in the shape
    data.tokenize_data gives the preview (workbench/outputs/preview.py): a preview never reads a stream whole."""
    import datasets

    check_source(cfg.train)
    count = min(rows or PREVIEW_ROWS, cfg.limit or float("inf"))
    read = list(itertools.islice(_read(cfg.train, cfg.split, cfg.format), count))
    if not read:
        raise DataError(f"{cfg.train}: no rows (the source is empty)")
    tokenized = datasets.Dataset.from_list([tokenize_row(item["row"], tokenizer, cfg, item["where"]) for item in read])
    source = SourceData(cfg.sources[0], cfg, Rows([item["row"] for item in read], cfg.train,
                                                  lambda i: read[i]["where"], ""), tokenized)
    eval_rows = eval_tok = None
    if cfg.eval:
        eval_rows = load_rows(cfg.eval, cfg.split, row_check(cfg.format), format_of(cfg.format).fields)
        eval_tok, _ = tokenize_rows(eval_rows, tokenizer, cfg)
    return TokenizedData([source], tokenized, eval_rows, eval_tok, cached=False)

"""Training data: load rows, render them with the chat template, mask prompts, truncate, pack, collate.

Every example becomes `input_ids`, `labels` (-100 where no loss is taken) and `position_ids`.
A sample starts wherever positions do not continue (`sample_starts`). Packed examples hold several
samples whose positions restart at 0: transformers then builds a block-diagonal causal mask, so a
sample attends only to itself. A preference pair may hold its prompt once, its rejected answer's
positions continuing the prompt (`shared_prompt_layout`; the CPU's per-sample attention reads it).
The collator never builds an attention mask: padding continues the row's last sample, and targets
never cross a sample boundary.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import math
import random
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from workbench.base.builtin import cache_dir
from workbench.base.errors import DataError
from workbench.spec import formats
from workbench.spec.chat_templates import TemplateBudgetError, TemplateFailure
from workbench.spec.formats import format_of
from workbench.spec.recipe import DataSection

IGNORE = -100
PIPELINE_VERSION = "3"  # bump when tokenization output changes, to invalidate caches
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


# -- loading rows -----------------------------------------------------------------------------


@dataclass
class Rows:
    """Raw rows and a way to say where row i came from (file:line for error messages)."""

    dataset: Any
    source: str
    where: Callable[[int], str]
    fingerprint: str


def load_rows(path: str, split: str = "train", check_row: Callable[[dict, str], None] | None = None,
              needs: tuple[str, ...] = ()) -> Rows:
    """Rows of a local file or hub data set. `check_row(row, where)` pinpoints a bad row when the
    file as a whole cannot be read (pyarrow refuses mixed types without saying where). `needs`: the columns
    every row must fill (a CSV cell left empty is named by its line and column)."""
    import datasets

    local = Path(path)
    if local.exists():
        builder = LOCAL_FORMATS.get(local.suffix.lower())
        if builder is None:
            raise DataError(f"{path}: unsupported file type '{local.suffix}' (use {', '.join(LOCAL_FORMATS)})")
        if local.is_dir():
            raise DataError(f"{path}: is a folder; give a {', '.join(LOCAL_FORMATS)} file")
        if not local.is_file():  # a FIFO or a device would block the reader, or never end
            raise DataError(f"{path}: not a regular file; give a {', '.join(LOCAL_FORMATS)} file")
        lines = None
        try:
            if local.suffix.lower() == ".jsonl":
                lines = _check_json_lines(local)  # a precise file:line beats pyarrow's parse error
            elif local.suffix.lower() == ".json":
                _check_json_document(local)
            where = _row_locator(local)
            digest, snapshot = _snapshot(local)
        except OSError as err:
            raise DataError(f"{path}: cannot read ({err.strerror or err})") from None
        try:
            # Parse the snapshot, not the file: the rows are the bytes that were hashed. (datasets caches a
            # local file by path and mtime, so a rewritten file with an old mtime would come back stale.)
            dataset = datasets.load_dataset(builder, data_files=str(snapshot), split="train",
                                            **(csv_as_text(snapshot) if builder == "csv" else {}))
        except Exception as err:  # pyarrow/datasets raise many types for malformed files
            if local.suffix.lower() == ".jsonl":
                _check_each_line(local, where, check_row, arrow_refused=True)
                # every row is sound: pyarrow's JSON reader tripped on its own (e.g. a list of nulls after a
                # blank line), so build the rows from Python's reading of the same bytes
                try:
                    dataset = datasets.Dataset.from_list([json.loads(line) for _, line in json_lines(snapshot)])
                except Exception:  # noqa: BLE001  the original error says more
                    raise DataError(f"{path}: cannot read as {builder}: {first_line(err)}") from None
            else:
                if local.suffix.lower() == ".csv":
                    check_utf8(local)
                raise DataError(f"{path}: cannot read as {builder}: {first_line(err)}") from None
        untyped = _untyped(dataset.features)
        if untyped and local.suffix.lower() == ".jsonl":
            # a column of several JSON types comes back re-read value by value ("1." as 1.0, blamed on a good row):
            # check the rows as Python reads them, naming the row at fault (a column of empty objects is untyped too,
            # and harmless)
            _check_each_line(local, where, check_row, arrow_refused=False)
        if builder == "csv":
            _check_cells(dataset, needs, where)
        if lines is not None and len(dataset) != lines:  # never train on fewer rows than the file holds
            raise DataError(f"{path}: the JSON reader returned {len(dataset)} rows for {lines} non-blank lines; "
                            "check the file for rows it cannot represent")
        return Rows(dataset, path, where, digest)
    if path.count("/") != 1 or path.startswith((".", "/")):
        raise DataError(f"{path}: no such file (and not a hub data set name of the form owner/name)")
    try:
        dataset = datasets.load_dataset(path, split=split)
    except Exception as err:
        raise DataError(f"{path}: cannot load hub data set (offline or not found): {first_line(err)}") from None
    return Rows(dataset, path, lambda i: f"{path}[{split}] row {i}", f"hub:{path}:{split}:{dataset._fingerprint}")


def csv_as_text(path: Path) -> dict:
    """The CSV reader's options that keep every cell the text it holds: a column of numbers stays text ("4", not
    4.0), "NA" or "null" stay words, and an empty cell is "" (not a missing value, nor NaN)."""
    import datasets
    import pandas as pd

    columns = pd.read_csv(path, nrows=0).columns  # the header as the reader names it (duplicates made unique)
    return {"features": datasets.Features({str(c): datasets.Value("string") for c in columns}),
            "keep_default_na": False}


def _check_cells(dataset, needs: tuple[str, ...], where: Callable[[int], str]) -> None:
    """An empty cell in a column the format needs, named by its line and column."""
    for column in (c for c in needs if c in dataset.column_names):
        empty = next((i for i, value in enumerate(dataset[column]) if value is None or value == ""), None)
        if empty is not None:
            raise empty_cell(where(empty), column)


def empty_cell(where: str, column: str) -> DataError:
    return DataError(f"{where}: the cell in column '{column}' is empty")


def json_lines(path: Path):
    """(line number, text) of each non-blank line. Blank means JSON whitespace only, as for pyarrow
    (str.strip would also skip a line of control characters that pyarrow fails on); bytes that are
    not UTF-8 come through as surrogates."""
    with path.open(encoding="utf-8", errors="surrogateescape") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip(" \t\r\n"):
                yield number, line


def _check_json_lines(path: Path) -> int:
    """The number of rows, each checked to be a JSON object with at least one field."""
    number, rows = 0, 0
    for number, line in json_lines(path):
        rows += 1
        json_row(path, number, line)
    if not number:
        raise DataError(f"{path}: no rows (the file is empty or blank)")
    return rows


def json_row(path: Path, number: int, line: str) -> dict:
    """Line `number` of a JSON lines file as a row: a JSON object with at least one field, else DataError naming
    the line."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = ord(line[err.start]) - 0xDC00  # surrogateescape keeps the raw byte
        raise DataError(f"{path}:{number}: not UTF-8 text (byte {byte:#04x} at column {err.start + 1})") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
    except RecursionError:
        raise DataError(f"{path}:{number}: invalid JSON (nested too deeply)") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}")
    if not row:  # the JSON reader silently drops `{}` beside a list-valued field
        raise DataError(f"{path}:{number}: an empty row ({{}}): give it the data format's fields or remove it")
    return row


def _check_json_document(path: Path) -> None:
    """A .json file holds one array (or object) of rows, or one object per line. Checked before
    datasets reads it: datasets 5.2 with pyarrow 26 kills the process on a file holding `null`."""
    check_utf8(path)
    text = path.read_text(encoding="utf-8-sig")
    try:
        document = json.loads(text)
    except RecursionError:
        raise DataError(f"{path}: invalid JSON (nested too deeply)") from None
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and "\n" not in text[: err.pos].strip():  # JSON lines under a .json name
            _check_json_lines(path)
            return
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(document, (list, dict)):
        raise DataError(f"{path}: a .json file must hold an array of rows, got {type(document).__name__}")


MAX_JSON_DEPTH = 63  # pyarrow's JSON reader refuses deeper nesting


def text_problem(line: str, row: dict) -> str | None:
    """Why a line Python's json module reads is not a row for any reader (a field given twice keeps only its last
    value; a lone surrogate is not text a tokenizer takes), or None."""
    keys = [key for key, _ in json.loads(line, object_pairs_hook=lambda pairs: pairs)]
    if len(set(keys)) < len(keys):
        return f"field '{next(k for k in keys if keys.count(k) > 1)}' appears twice"
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "a string holds an unpaired surrogate escape (\\ud800-\\udfff): not valid Unicode"
    return None


def _arrow_refuses(line: str, row: dict) -> str | None:
    """Why pyarrow cannot read a line that Python's json module reads, or None."""
    problem = text_problem(line, row)
    if problem:
        return problem
    depth, level = 0, [row]
    while level:
        depth += 1
        values = [c for x in level for c in (x.values() if isinstance(x, dict) else x)]
        huge = next((v for v in values if type(v) is int and not -2**63 <= v < 2**63), None)
        if huge is not None:
            return f"the number {huge} does not fit the JSON reader's 64-bit integers (write it as a string)"
        for items in (x for x in level if isinstance(x, list)):
            kinds = sorted({_json_kind(item) for item in items if item is not None})
            if len(kinds) > 1:
                return f"a list mixes {kinds[0]} and {kinds[1]}: the JSON reader needs one type per list"
        level = [c for c in values if isinstance(c, (dict, list))]
    if depth > MAX_JSON_DEPTH:
        return f"nested {depth} levels deep, more than the JSON reader's {MAX_JSON_DEPTH}"
    return None


def _untyped(feature) -> bool:
    """Whether the reader kept any column, at any depth (a field of the objects in a list too), as untyped JSON."""
    if type(feature).__name__ == "Json":
        return True
    if isinstance(feature, dict):
        return any(_untyped(inner) for inner in feature.values())
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and _untyped(inner)


def _check_each_line(path: Path, where: Callable[[int], str], check_row, arrow_refused: bool) -> None:
    """Each row as Python's json module reads it, in file order: the first that fails `check_row` (or, where pyarrow
    refused the file, that pyarrow cannot represent) is named by its line, then a column that changes its JSON
    type."""
    for i, (_, line) in enumerate(json_lines(path)):
        row = json.loads(line)
        problem = _arrow_refuses(line, row) if arrow_refused else None
        if problem:
            raise DataError(f"{where(i)}: {problem}") from None
        if check_row is not None:
            check_row(row, where(i))
    _check_field_types(path, where)


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}[type(value)]


def _check_field_types(path: Path, where: Callable[[int], str]) -> None:
    """A column must keep one JSON type (null aside): name the first row where a field changes it."""
    first_seen: dict[str, tuple[str, int]] = {}
    for i, (_, line) in enumerate(json_lines(path)):
        row = json.loads(line)
        for field_name, value in (row.items() if isinstance(row, dict) else ()):
            if value is None:
                continue
            kind = _json_kind(value)
            seen_kind, seen_at = first_seen.setdefault(field_name, (kind, i))
            if kind != seen_kind:
                raise DataError(f"{where(i)}: field '{field_name}' is {kind} here but {seen_kind} at "
                                f"{where(seen_at)} (a column keeps one type)")


def check_utf8(path: Path) -> None:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{number}: not UTF-8 text (byte {line[err.start]:#04x} at column {err.start + 1})"
                ) from None


def _row_locator(path: Path) -> Callable[[int], str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        lines = [n for n, _ in json_lines(path)]
        return lambda i: f"{path}:{lines[i]}" if i < len(lines) else f"{path} row {i}"
    if suffix == ".csv":
        return lambda i: f"{path}:{i + 2}"  # header is line 1
    return lambda i: f"{path} record {i}"


def _snapshot(path: Path) -> tuple[str, Path]:
    """(sha256, path of a copy of exactly those bytes): a content-addressed copy under the cache dir, so the
    data that is tokenized is the data whose hash keys the cache, whatever happens to the file meanwhile."""
    digest = hashlib.sha256()
    folder = cache_dir() / "sources"
    staging = folder / f".{os.getpid()}.{threading.get_ident()}.{path.name}.tmp"  # concurrent readers: one each
    try:
        folder.mkdir(parents=True, exist_ok=True)
        staging.open("wb").close()
    except OSError as err:
        raise DataError(f"the cache folder {folder} is not writable ({err.strerror or err}); set "
                        "LORA_WORKBENCH_CACHE to a writable folder") from None
    try:
        with path.open("rb") as source, staging.open("wb") as copy:
            for chunk in iter(lambda: source.read(1 << 20), b""):
                digest.update(chunk)
                copy.write(chunk)
        snapshot = folder / f"{digest.hexdigest()}{path.suffix.lower()}"
        if snapshot.exists():
            staging.unlink()
        else:
            os.replace(staging, snapshot)
    finally:
        staging.unlink(missing_ok=True)
    return digest.hexdigest(), snapshot


def first_line(err: Exception) -> str:
    while err.__cause__ is not None:  # datasets wraps the parser's error in "An error occurred while generating"
        err = err.__cause__
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# -- rows to token ids ------------------------------------------------------------------------


def check_row(row: dict, fmt: str, where: str) -> None:
    """Raise DataError naming `where` if the row does not have the fields its format needs."""
    format_of(fmt).check(row, where)


# Tokenizing takes ~175 bytes of memory per character of text: a 50 MB line would take 9 GB only to be cut to
# data.max_seq_len tokens. So a text is tokenized only as far as truncation keeps it: cut after enough characters
# for the tokens still wanted and a margin, the first guess doubled until the cut text gives that many. A cut
# changes only the last few tokens before it, which the margin holds: the tokens kept are the whole text's own.
CUT_MARGIN = 64  # tokens tokenized past those kept
CHARS_PER_TOKEN = 8  # the first guess (text holds 3 to 5 characters per token; a longer token is found by doubling)


def leading_ids(tokenizer, text: str, wanted: int) -> list[int]:
    """The token ids of `text`, or its first `wanted` (or more) where it holds more: what truncation keeps of it,
    found with memory bounded by `wanted` rather than by the text's length."""
    chars = (wanted + CUT_MARGIN) * CHARS_PER_TOKEN
    while chars < len(text):
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= wanted + CUT_MARGIN:
            return ids[:wanted]
        chars *= 2
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_segments(segments, tokenizer, cfg: DataSection) -> dict:
    """One sample: token ids, labels (IGNORE where no loss is taken), truncated to data.max_seq_len."""
    input_ids: list[int] = []
    labels: list[int] = []
    for text, is_answer in segments:
        wanted = cfg.max_seq_len + 1 - len(input_ids)  # one past the limit tells that truncation cut the sample
        if wanted <= 0:
            break  # truncation drops the rest whole
        ids = leading_ids(tokenizer, text, wanted)
        if is_answer and tokenizer.eos_token_id not in ids:
            ids = ids + [tokenizer.eos_token_id]  # the model must learn to stop
        input_ids += ids
        learn = is_answer or cfg.train_on == "all"
        labels += ids if learn else [IGNORE] * len(ids)
    truncated = len(input_ids) > cfg.max_seq_len
    input_ids, labels = input_ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
    # A sample's first label can never be predicted (nothing precedes it).
    targets = sum(1 for label in labels[1:] if label != IGNORE)
    return {"input_ids": input_ids, "labels": labels, "truncated": truncated, "targets": targets}


def tokenize_row(row: dict, tokenizer, cfg: DataSection, where: str, share_prompts: bool = False,
                 mismatched: str | None = None) -> dict:
    """A row as training sees it. A preference row is one example holding two samples, chosen then rejected,
    whose positions restart at 0 (so each attends only to itself, as packed samples do). An unpaired row holds
    its answer, then `mismatched` (another row's answer) to the same prompt: KTO's KL sample, never learned.
    share_prompts: the two samples hold their prompt once instead (shared_prompt_layout), and `whole_length`
    keeps the two whole sequences' length, which packing bins by."""
    fmt = format_of(cfg.format)
    if fmt.unpaired:
        return _tokenize_unpaired(row, tokenizer, cfg, where, share_prompts, mismatched)
    if not fmt.preference:
        return tokenize_segments(_rendered(fmt.segments, row, tokenizer, cfg, where), tokenizer, cfg)
    chosen, rejected = tokenize_pair(row, tokenizer, cfg, where)
    # a pair that lost an answer, or whose answers truncation made the same, teaches nothing: left out, counted
    both = chosen["targets"] > 0 and rejected["targets"] > 0 and chosen["labels"] != rejected["labels"]
    return _two_samples(chosen, rejected, share_prompts, truncated=chosen["truncated"] or rejected["truncated"],
                        targets=chosen["targets"] + rejected["targets"] if both else 0)


def _tokenize_unpaired(row: dict, tokenizer, cfg: DataSection, where: str, share_prompts: bool,
                       mismatched: str | None) -> dict:
    """[the answer][another row's answer to the same prompt]: the second sample is what KTO's KL term reads
    (objectives.KTO); its tokens are scored, not learned. `desirable` travels with the example through packing
    and collation, one entry per example."""
    fmt = format_of(cfg.format)
    unpaired = fmt.unpaired_row(row, where, cfg.system_prompt)

    def sample(answer_text: str) -> dict:
        def render(*_):
            return formats.unpaired_segments(unpaired, answer_text, tokenizer, where)
        return tokenize_segments(_rendered(render, row, tokenizer, cfg, where), tokenizer, cfg)

    answer = sample(unpaired.completion)
    kl = sample(unpaired.completion if mismatched is None else mismatched)  # None: scoring a row on its own
    return {**_two_samples(answer, kl, share_prompts, truncated=answer["truncated"], targets=answer["targets"]),
            "desirable": [unpaired.desirable]}


def _two_samples(first: dict, second: dict, share_prompts: bool, **example) -> dict:
    """Two samples in one example, positions restarting at 0 for the second, or holding their prompt once."""
    if share_prompts:
        example["whole_length"] = len(first["input_ids"]) + len(second["input_ids"])
        shared = shared_prompt_length(first, second)
        if shared > 1:  # one shared token is the one each answer repeats: nothing would be saved
            return {**shared_prompt_layout(first, second, shared), **example}
    return {"input_ids": first["input_ids"] + second["input_ids"], "labels": first["labels"] + second["labels"],
            "position_ids": list(range(len(first["input_ids"]))) + list(range(len(second["input_ids"]))),
            **example}


def shared_prompt_length(chosen: dict, rejected: dict) -> int:
    """How many leading tokens the two samples share that carry no target: their common prompt."""
    shared = 0
    for a, b, label_a, label_b in zip(chosen["input_ids"], rejected["input_ids"], chosen["labels"],
                                      rejected["labels"]):
        if a != b or label_a != IGNORE or label_b != IGNORE:
            break
        shared += 1
    return shared


def shared_prompt_layout(chosen: dict, rejected: dict, shared: int) -> dict:
    """[prompt but its last token][last prompt token + chosen][last prompt token + rejected]: positions run on
    through the chosen answer and restart at the repeated token for the rejected one, which so continues the
    prompt (workbench/model/packed_attention.py reads that). The prompt's last token is in both answers because it
    predicts the first token of each. The same log-probabilities as two whole samples, with the prompt's work
    done once."""
    cut = shared - 1
    return {"input_ids": chosen["input_ids"] + rejected["input_ids"][cut:],
            "labels": chosen["labels"] + rejected["labels"][cut:],
            "position_ids": list(range(len(chosen["input_ids"]))) + list(range(cut, len(rejected["input_ids"])))}


def tokenize_pair(row: dict, tokenizer, cfg: DataSection, where: str) -> tuple[dict, dict]:
    """A preference row's chosen and rejected samples, each tokenized (and truncated) on its own."""
    pair = _rendered(format_of(cfg.format).pair, row, tokenizer, cfg, where)
    return tokenize_segments(pair[0], tokenizer, cfg), tokenize_segments(pair[1], tokenizer, cfg)


def _rendered(render, row: dict, tokenizer, cfg: DataSection, where: str):
    """A format's rendering of a row; a chat template that refuses the row (jinja's raise_exception, e.g.
    roles that do not alternate) is named with the row's file:line."""
    from jinja2 import TemplateError

    try:
        return render(row, tokenizer, cfg.system_prompt, where)
    except TemplateError as err:
        raise DataError(f"{where}: {template_name(cfg)} refuses this row: {first_line(err)}") from None
    except TemplateBudgetError as err:
        raise DataError(f"{where}: {template_name(cfg)} gives up on this row: {err}") from None
    except TemplateFailure as err:
        raise DataError(f"{where}: {template_name(cfg)} fails on this row: {err}") from None


def template_name(cfg: DataSection) -> str:
    """How messages name the template that renders rows: the recipe's file or registered name, or the model's."""
    return (f"the chat template {cfg.chat_template} (data.chat_template)" if cfg.chat_template
            else "the tokenizer's chat template")


# -- the prepared data set --------------------------------------------------------------------


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset of examples (packs when packing)
    eval: Any | None
    stats: dict = field(default_factory=dict)


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([tokenizer.chat_template, tokenizer.eos_token_id, PIPELINE_VERSION])
    return hashlib.sha256((body + extra).encode()).hexdigest()


def chat_template_digest(tokenizer) -> str:
    """The hash of how rows become text: a resumed run must render them as it started (resume.check_data)."""
    return hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()


def tokenize_rows(rows: Rows, tokenizer, cfg: DataSection, limit: int | None = None, share_prompts: bool = False):
    """Tokenize every row (cached on disk by content, tokenizer and settings)."""
    import datasets

    settings = json.dumps([cfg.format, cfg.max_seq_len, cfg.train_on, cfg.system_prompt, limit]
                          + (["shared prompts, binned whole"] if share_prompts else []))
    key = hashlib.sha256(f"{rows.fingerprint}|{tokenizer_fingerprint(tokenizer)}|{settings}".encode()).hexdigest()
    folder = cache_dir() / "data" / key[:32]
    if (folder / "dataset_info.json").exists():
        return datasets.load_from_disk(str(folder)), True

    source = rows.dataset
    if limit is not None:
        source = source.select(range(min(limit, len(source))))
    mismatched = _mismatched_answers(source, rows, cfg)
    tokenized = source.map(
        lambda row, i: tokenize_row(row, tokenizer, cfg, rows.where(i), share_prompts,
                                    mismatched(i) if mismatched else None),
        with_indices=True,
        remove_columns=source.column_names,
        new_fingerprint=key[:32],
        desc=f"tokenizing {rows.source}",
    )
    # a staging folder of this writer's own: two processes (or UI threads) tokenizing the same data at once
    # each write theirs, the first rename wins, and the other's copy (the same bytes) is dropped
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    tokenized.save_to_disk(str(staging))
    if folder.exists() and not (folder / "dataset_info.json").exists():
        shutil.rmtree(folder, ignore_errors=True)  # left half-written by an interrupted older version
    try:
        staging.rename(folder)
    except OSError:
        if not (folder / "dataset_info.json").exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return datasets.load_from_disk(str(folder)), False


@dataclass
class SourceData:
    """One training source as read and tokenized: its rows, its settings (data.format replaced by its own)."""

    source: Any  # recipe.DataSource
    cfg: DataSection
    rows: Rows
    tokenized: Any  # before weighting and holding out


@dataclass
class TokenizedData:
    """The rows read and tokenized, split as training splits them; samples that lost their answer still in."""

    sources: list[SourceData]
    train: Any
    eval_rows: Rows | None
    eval: Any | None
    cached: bool
    mix: list[dict] = field(default_factory=list)  # per source: path, format, weight, rows, samples in train

    @property
    def mixed(self) -> bool:
        """Several sources, or one weighted: what trains is not simply the file."""
        return len(self.sources) > 1 or self.sources[0].source.weight != 1

    @property
    def train_fingerprint(self) -> str:
        """The content hash of the training data: the file's for one source, of the sources and weights for a mix."""
        if not self.mixed:
            return self.sources[0].rows.fingerprint
        parts = [f"{d.rows.fingerprint}|{d.source.format}|{d.source.weight!r}" for d in self.sources]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _mismatched_answers(source, rows: Rows, cfg: DataSection) -> Callable[[int], str] | None:
    """For unpaired rows: row i's KL sample answers its prompt with row i - 1's answer (the last row's for the
    first), TRL's rotation of completions by one. None for other formats."""
    fmt = format_of(cfg.format)
    if not fmt.unpaired:
        return None
    count = len(source)
    if count < 2:
        for i in range(count):  # a bad row is the first thing to fix
            fmt.unpaired_row(source[i], rows.where(i))
        raise DataError(f"{rows.source}: {count} unpaired row; KTO's KL estimate answers each row's prompt with "
                        "another row's answer, so a source needs at least 2 rows")

    def answer(i: int) -> str:
        k = (i - 1) % count
        if i == 0:  # row 0 is read before the last row it borrows from: a bad first row is named first
            fmt.unpaired_row(source[0], rows.where(0))
        return fmt.unpaired_row(source[k], rows.where(k)).completion

    return answer


def tokenize_data(cfg: DataSection, tokenizer, seed: int = 0, share_prompts: bool = False) -> TokenizedData:
    """Each source read and tokenized with its own format; data.eval_split held out of each source, then each
    source's rows weighted (mix_sources) and the sources concatenated into one training set."""
    sources, cached = [], True
    for source in cfg.sources:
        source_cfg = cfg.model_copy(update={"train": source.path, "format": source.format})
        rows = load_rows(source.path, cfg.split, row_check(source.format), format_of(source.format).fields)
        tokenized, was_cached = tokenize_rows(rows, tokenizer, source_cfg, cfg.limit, share_prompts)
        if len(cfg.sources) > 1:  # one source alone is judged whole by check_trainable
            _check_source_trainable(tokenized, len(sources), source.path, cfg)
        sources.append(SourceData(source, source_cfg, rows, tokenized))
        cached = cached and was_cached
    trains, held_out = [], []
    for data in sources:
        train_tok = data.tokenized
        if not cfg.eval and cfg.eval_split:
            train_tok, held = hold_out(train_tok, cfg.eval_split, seed, data.source.path)
            held_out.append(held)
        trains.append(train_tok)
    trains = mix_sources(trains, [d.source for d in sources], seed)
    mix = [{"path": d.source.path, "format": d.source.format, "weight": d.source.weight, "rows": len(d.tokenized),
            "samples": len(part)} for d, part in zip(sources, trains)]
    eval_tok, eval_rows = None, None
    if cfg.eval:
        eval_rows = load_rows(cfg.eval, cfg.split, row_check(cfg.format), format_of(cfg.format).fields)
        eval_tok, _ = tokenize_rows(eval_rows, tokenizer, cfg, share_prompts=share_prompts)
    elif held_out:
        eval_tok = _concatenated(held_out)
    return TokenizedData(sources, _concatenated(trains), eval_rows, eval_tok, cached, mix)


def row_check(fmt: str) -> Callable[[dict, str], None]:
    return lambda row, where: check_row(row, fmt, where)


def _concatenated(parts: list):
    import datasets

    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def hold_out(tokenized, fraction: float, seed: int, source: str):
    """(train, held out): `fraction` of a source's rows, drawn with `seed` (evaluation.eval_rows finds the
    same rows again through held_out_indices)."""
    held = math.ceil(len(tokenized) * fraction)
    if not 0 < held < len(tokenized):
        raise DataError(f"{source}: data.eval_split {fraction} of {len(tokenized)} rows leaves no "
                        "rows to train on; lower it or give data.eval a file")
    train, test = held_out_indices(len(tokenized), fraction, seed)
    return tokenized.select(train), tokenized.select(test)


def held_out_indices(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(kept, held out) row indices of data.eval_split: the one place that draws them."""
    import datasets

    index = datasets.Dataset.from_dict({"i": list(range(count))})
    parts = index.train_test_split(test_size=fraction, seed=seed, shuffle=True)
    return parts["train"]["i"], parts["test"]["i"]


def mix_sources(parts: list, sources: list, seed: int) -> list:
    """Each source's rows `weight` times over: every row `floor(weight)` times, and a seeded choice of the rest
    (weight 2.5 of 10 rows: each twice and 5 drawn once more; 0.5: a seeded half). Fixed by the seed, so a
    resumed run trains on the very rows it started with; the epoch sampler shuffles the whole."""
    mixed = []
    for k, (part, source) in enumerate(zip(parts, sources)):
        if source.weight == 1:
            mixed.append(part)
            continue
        count = round(len(part) * source.weight)
        if count == 0:
            raise DataError(f"data.train[{k}].weight: {source.weight:g} of the {len(part)} rows of {source.path} "
                            "keeps none; raise it")
        whole, rest = divmod(count, len(part))
        extra = sorted(random.Random(f"{seed}:{k}").sample(range(len(part)), rest))
        mixed.append(part.select([i for _ in range(whole) for i in range(len(part))] + extra))
    return mixed


def _check_source_trainable(tokenized, k: int, path: str, cfg: DataSection) -> None:
    """A source of a mix that truncation (or data.limit) leaves without a target token: refused by name rather
    than dropped from the mix without a word."""
    if not any(t > 0 for t in tokenized["targets"]):
        raise DataError(f"data.train[{k}] ({path}): no sample keeps a target token after truncation at "
                        f"data.max_seq_len={cfg.max_seq_len}; raise data.max_seq_len, shorten its prompts or "
                        "drop the source")


def check_trainable(train_tok, cfg: DataSection) -> None:
    """Refuse data of which truncation leaves nothing to learn."""
    empty = sum(1 for t in train_tok["targets"] if t == 0)
    if len(train_tok) and empty == len(train_tok):
        raise every_answer_truncated(cfg)
    if len(train_tok) == 0:
        raise DataError(f"{cfg.train_name}: no training sample has a target token left after truncation")


def prepare_data(cfg: DataSection, tokenizer, seed: int = 0, share_prompts: bool = False,
                 whole_only: bool = False) -> PreparedData:
    """share_prompts: each preference pair holds its prompt once (attention.shares_prompts says when it may).
    whole_only: examples that truncation cut are left out and counted (`train_cut`, `eval_cut`): a reward model
    reads each sample's last token, which in a cut sample is mid-answer (TRL's RewardTrainer drops such pairs)."""
    tokenized = tokenize_data(cfg, tokenizer, seed, share_prompts)
    train_tok, eval_tok = tokenized.train, tokenized.eval
    stats = {"cached": tokenized.cached, **_summarise(train_tok, "train"),
             "train_sha256": tokenized.train_fingerprint,
             "chat_template_sha256": chat_template_digest(tokenizer)}
    if format_of(cfg.format).sequences_per_example > 1:
        stats["shared_prompts"] = share_prompts
    check_trainable(train_tok, cfg)
    if tokenized.mixed:
        stats["mix"] = tokenized.mix
    if tokenized.eval_rows is not None:
        stats["eval_sha256"] = tokenized.eval_rows.fingerprint
    train_tok = drop_empty(train_tok)
    if whole_only:
        train_tok, stats["train_cut"] = whole_training_examples(train_tok, cfg)
    evaluation = evaluation_examples(eval_tok, cfg, whole_only, stats)
    train = examples_of(train_tok, cfg)
    stats["train_examples"] = len(train)
    return PreparedData(train, evaluation, stats)


def evaluation_examples(eval_tok, cfg: DataSection, whole_only: bool, stats: dict):
    """The held-out samples as evaluation reads them (None: there are none); their figures go into `stats`."""
    if eval_tok is None:
        return None
    stats.update(_summarise(eval_tok, "eval"))
    eval_tok = drop_empty(eval_tok)
    if whole_only:
        eval_tok, stats["eval_cut"] = drop_cut(eval_tok)
    return examples_of(eval_tok, cfg) if len(eval_tok) else None


def examples_of(tokenized, cfg: DataSection):
    """Tokenized samples as batches hold them: packed into rows of data.row_len, or one per row."""
    return pack(tokenized, cfg.row_len) if cfg.packing else with_positions(tokenized)


def _summarise(dataset, role: str) -> dict:
    import pyarrow.compute as pc

    return {
        f"{role}_samples": len(dataset),
        f"{role}_tokens": int(pc.sum(pc.list_value_length(dataset.with_format("arrow")["input_ids"])).as_py() or 0),
        f"{role}_target_tokens": sum(dataset["targets"]),
        f"{role}_truncated": sum(dataset["truncated"]),
        f"{role}_empty": sum(1 for t in dataset["targets"] if t == 0),
    }


def drop_empty(dataset):
    keep = [i for i, t in enumerate(dataset["targets"]) if t > 0]
    return dataset if len(keep) == len(dataset) else dataset.select(keep)


def whole_training_examples(dataset, cfg: DataSection):
    """(the training examples truncation left whole, how many it cut) for a reward model, which reads whole samples;
    none left is an error naming the limit."""
    kept, cut = drop_cut(dataset)
    if len(kept) == 0:
        raise every_example_cut(cfg)
    return kept, cut


def every_answer_truncated(cfg: DataSection) -> DataError:
    return DataError(f"{cfg.train_name}: every sample loses its whole answer to truncation at data.max_seq_len="
                     f"{cfg.max_seq_len}; raise data.max_seq_len or shorten the prompts")


def every_example_cut(cfg: DataSection) -> DataError:
    return DataError(f"{cfg.train_name}: every example is longer than data.max_seq_len={cfg.max_seq_len} "
                     "(a reward model reads whole samples); raise data.max_seq_len")


def drop_cut(dataset):
    """(the examples truncation left whole, how many it cut)."""
    keep = [i for i, cut in enumerate(dataset["truncated"]) if not cut]
    return (dataset if len(keep) == len(dataset) else dataset.select(keep)), len(dataset) - len(keep)


def with_positions(dataset):
    if "position_ids" in dataset.column_names:  # examples of several samples carry their own
        extra = [c for c in ("truncated", "targets", "whole_length") if c in dataset.column_names]
        return dataset.remove_columns(extra)
    return dataset.map(lambda row: {"position_ids": list(range(len(row["input_ids"])))},
                       remove_columns=["truncated", "targets"])


PACK_CHUNK_TOKENS = 2 ** 18  # about how many tokens of packed rows are built in memory at a time


def pack(dataset, max_seq_len: int):
    """Best-fit-decreasing packing: fewest sequences of at most max_seq_len tokens. An example of several
    samples (a preference pair) stays whole and in order. Pairs that hold their prompt once are binned by their
    two whole sequences' length, so they fill the rows and steps whole pairs would (the rows only get shorter).

    Only the lengths are held in memory (read from the Arrow columns); the packed rows are written to the cache
    a chunk of examples at a time and memory-mapped back, so preparing a data set far larger than memory takes
    memory for its lengths and bins, not its tokens."""
    import datasets
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    lengths = (table["whole_length"].to_numpy() if "whole_length" in dataset.column_names
               else pc.list_value_length(table["input_ids"]).to_numpy())
    members, ends = best_fit_decreasing(lengths, max_seq_len)
    columns = ["input_ids", "labels", *(c for c in ("position_ids", "desirable") if c in dataset.column_names)]

    def packed_chunks():
        per_chunk = max(1, PACK_CHUNK_TOKENS // max_seq_len)
        starts = [0, *ends[:-1]]
        for first in range(0, len(ends), per_chunk):
            bounds = list(zip(starts[first:first + per_chunk], ends[first:first + per_chunk]))
            offset = bounds[0][0]
            rows = table[members[offset:bounds[-1][1]].tolist()].select(columns).to_pydict()
            if "position_ids" not in rows:
                rows["position_ids"] = [list(range(len(ids))) for ids in rows["input_ids"]]
            batch = {name: [] for name in rows}
            for start, end in bounds:
                for name, values in rows.items():  # unpaired rows' labels too, one per example, in the pack's order
                    batch[name].append([x for k in range(start - offset, end - offset) for x in values[k]])
            yield batch

    features = datasets.Features({**{name: datasets.List(datasets.Value("int32"))
                                     for name in ("input_ids", "labels", "position_ids")},
                                  **({"desirable": datasets.List(datasets.Value("bool"))}
                                     if "desirable" in columns else {})})
    key = hashlib.sha256(f"{dataset._fingerprint}|{max_seq_len}|{PIPELINE_VERSION}|pack".encode()).hexdigest()
    return _written_once(cache_dir() / "data" / "packed" / f"{key[:32]}.arrow", features, packed_chunks)


def _written_once(path: Path, features, batches) -> Any:
    """The data set of `batches` written to `path` (an Arrow file, memory-mapped back), or the one an earlier
    call wrote there. Written under a name of this writer's own and renamed into place: two processes packing
    at once each write theirs and the last rename wins (the same bytes); a crash leaves no half file."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            writer = ArrowWriter(features=features, path=str(staging))
            try:
                for batch in batches():
                    writer.write_batch(batch)
                writer.finalize()
            finally:
                writer.close()
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)
    return datasets.Dataset.from_file(str(path))


def best_fit_decreasing(lengths, capacity: int):
    """Bins of example indices, each bin's lengths summing to at most `capacity`: the longest example first into
    the fullest bin it fits (ties: the lower index first, so the bins are the same on every process). Returned
    flat, as arrays of a few bytes per example: (members, ends), bin b holding members[ends[b-1]:ends[b]] in the
    order they went in."""
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, then the lower index
    bin_of = np.empty(len(lengths), dtype=np.int64)
    free: list[tuple[int, int]] = []  # sorted (room left, bin index)
    bins = 0
    for start in range(0, len(order), 1 << 20):  # Python ints a slice at a time
        for i in order[start:start + (1 << 20)].tolist():
            length = int(lengths[i])
            slot = bisect.bisect_left(free, (length, -1))
            if slot < len(free):
                room, b = free.pop(slot)
            else:
                room, b = capacity, bins
                bins += 1
            bin_of[i] = b
            bisect.insort(free, (room - length, b))
    members = order[np.argsort(bin_of[order], kind="stable")]
    return members, np.cumsum(np.bincount(bin_of, minlength=bins)).tolist()


# -- batches ----------------------------------------------------------------------------------


class Collator:
    """Right-pads a list of examples into tensors and shifts labels into next-token targets.

    `labels[t]` is the target for position t (the token at t+1), or -100 where t+1 starts a new
    sample or is padding, so no loss ever crosses a sample boundary.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict:
        longest = max(len(e["input_ids"]) for e in examples)
        width = -(-longest // self.multiple) * self.multiple
        batch = {name: torch.full((len(examples), width), fill, dtype=torch.long)
                 for name, fill in (("input_ids", self.pad_token_id), ("labels", IGNORE), ("position_ids", 0))}
        batch["num_samples"] = 0
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            batch["input_ids"][row, :n] = torch.tensor(example["input_ids"])
            positions = torch.tensor(example["position_ids"])
            batch["position_ids"][row, :n] = positions
            # padding continues the row's last sample: it attends only backwards and carries no target, so the real
            # tokens are untouched, and a row of one sample stays one sample (no mask needed on a GPU)
            batch["position_ids"][row, n:] = torch.arange(width - n) + (positions[-1] + 1 if n else 0)
            labels = torch.tensor(example["labels"])
            starts = sample_starts(positions)
            batch["labels"][row, : n - 1] = torch.where(starts[1:], IGNORE, labels[1:])
            batch["num_samples"] += int(starts.sum())
        if "desirable" in examples[0]:  # unpaired rows: one label per example of two samples, in batch order
            batch["desirable"] = torch.tensor([d for e in examples for d in e["desirable"]], dtype=torch.bool)
        # counts for throughput and FLOPs, as Python ints: the loop reads them without waiting for the device
        batch["num_tokens"] = sum(len(e["input_ids"]) for e in examples)
        # causal attention work: a real token at position p attends to p + 1 positions
        batch["num_attended"] = sum(p + 1 for e in examples for p in e["position_ids"])
        if any(e.get(STAND_IN) for e in examples):  # trains nothing and counts nothing (StepBatches)
            batch[STAND_IN], batch["num_tokens"], batch["num_attended"] = True, 0, 0
        return batch


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """True where a sample starts: at the first position of a row and wherever positions do not continue (a new
    sample at 0, or an answer continuing its pair's shared prompt)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts


class EpochSampler(torch.utils.data.Sampler):
    """A seeded permutation per epoch, so a resumed run sees exactly the same order."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        self.size, self.seed, self.shuffle, self.epoch = size, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.size))
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return iter(order)


STAND_IN = "stand_in"


class StepBatches(torch.utils.data.Sampler):
    """This process's micro-batches of each epoch (a batch sampler): every optimizer step holds the same samples
    whatever the process count and the micro-batch x accumulation split of the same samples per step.

    The epoch's order (EpochSampler) is cut into chunks of `micro_batch` samples, dealt to the processes in turn:
    process r takes chunks r, r + W, r + 2W, ... Each step of `grad_accum` micro-batches on every process then holds
    the next micro x accumulation x W samples of the order. An epoch they do not divide ends on a short step holding
    the rest, in which a process may have a short chunk or none: for a missing chunk it runs a stand-in (a sample
    marked STAND_IN, weighted by zero), so that every process runs the same passes, whose collectives (DDP, FSDP,
    DeepSpeed) wait for each other. No sample is repeated and none left out (accelerate's sharding of a loader
    fills such a step up with samples from the start of the epoch)."""

    def __init__(self, size: int, micro_batch: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True):
        self.order = EpochSampler(size, seed, shuffle)
        self.micro_batch, self.world_size, self.rank, self.skip = micro_batch, world_size, rank, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The epoch to deal next, from this process's micro-batch `skip` on (a resumed run)."""
        self.order.set_epoch(epoch)
        self.skip = skip

    def __len__(self) -> int:
        """This process's micro-batches in a whole epoch (the same on every process)."""
        return math.ceil(math.ceil(self.order.size / self.micro_batch) / self.world_size)

    def __iter__(self):
        order = list(self.order)
        for k in range(self.skip, len(self)):
            start = (k * self.world_size + self.rank) * self.micro_batch
            yield order[start:start + self.micro_batch] or [-1 - order[-1]]  # TrainRows: index -1 - i stands in


class FirstEpochBatches:
    """The first epoch's micro-batches as one process of `world_size` (rank `rank`) is dealt them, each with the mask
    of its real positions (not padding, not a stand-in): what a data-driven adapter init (EVA) reads. Collated as
    they are read (a reader that cycles them, as peft's EVA does, keeps those it has read)."""

    def __init__(self, rows, collate, micro_batch: int, world_size: int, rank: int, seed: int):
        self.rows, self.collate = TrainRows(rows), collate
        self.dealt = StepBatches(len(rows), micro_batch, world_size, rank, seed)

    def __len__(self) -> int:
        return len(self.dealt)

    def __iter__(self):
        self.dealt.set_epoch(0)
        for indices in self.dealt:
            examples = self.rows.__getitems__(indices)
            batch = self.collate(examples)
            lengths = torch.tensor([0 if e.get(STAND_IN) else len(e["input_ids"]) for e in examples])
            mask = torch.arange(batch["input_ids"].shape[1])[None] < lengths[:, None]
            yield {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": mask}


def first_rows(rows, seed: int, count: int) -> list[dict]:
    """The first `count` training rows of the first epoch, the same on every process (CorDA's calibration)."""
    order = EpochSampler(len(rows), seed)
    return [rows[i] for i in list(order)[:count]]


class TrainRows(torch.utils.data.Dataset):
    """The training rows by index, for StepBatches: row i, or at index -1 - i row i as a stand-in."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index] if index >= 0 else {**self.rows[-1 - index], STAND_IN: True}

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """A micro-batch's rows in one read where the rows allow it (a data set's own __getitems__)."""
        read = getattr(self.rows, "__getitems__", None)
        return read(indices) if read is not None and min(indices) >= 0 else [self[i] for i in indices]

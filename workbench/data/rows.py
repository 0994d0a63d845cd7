"""Rows from a file or the hub, each checked where it stands: a bad line is named by its file and number,
before any is tokenized (JSON lines, JSON, CSV, Parquet; hub data sets through `datasets`)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from workbench.base.builtin import cache_dir
from workbench.base.errors import DataError, escaped
from workbench.base.hub_reach import check_hub_answers

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


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
            raise DataError(f"{escaped(path)}: unsupported file type '{local.suffix}' (use {', '.join(LOCAL_FORMATS)})")
        if local.is_dir():
            raise DataError(f"{escaped(path)}: is a folder; give a {', '.join(LOCAL_FORMATS)} file")
        if not local.is_file():  # a FIFO or a device would block the reader, or never end
            raise DataError(f"{escaped(path)}: not a regular file; give a {', '.join(LOCAL_FORMATS)} file")
        lines = None
        try:
            if local.suffix.lower() == ".jsonl":
                lines = _check_json_lines(local)  # a precise file:line beats pyarrow's parse error
            elif local.suffix.lower() == ".json":
                _check_json_document(local)
            where = _row_locator(local)
            digest, snapshot = _snapshot(local)
        except OSError as err:
            raise DataError(f"{escaped(path)}: cannot read ({err.strerror or err})") from None
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
                    raise DataError(f"{escaped(path)}: cannot read as {builder}: {first_line(err)}") from None
            else:
                if local.suffix.lower() == ".csv":
                    check_utf8(local)
                raise DataError(f"{escaped(path)}: cannot read as {builder}: {first_line(err)}") from None
        untyped = _untyped(dataset.features)
        if untyped and local.suffix.lower() == ".jsonl":
            # a column of several JSON types comes back re-read value by value ("1." as 1.0, blamed on a good row):
            # check the rows as Python reads them, naming the row at fault (a column of empty objects is untyped too,
            # and harmless)
            _check_each_line(local, where, check_row, arrow_refused=False)
        if builder == "csv":
            _check_cells(dataset, needs, where)
        if lines is not None and len(dataset) != lines:  # never train on fewer rows than the file holds
            raise DataError(f"{escaped(path)}: the JSON reader returned {len(dataset)} rows for {lines} non-blank "
                            "lines; check the file for rows it cannot represent")
        return Rows(dataset, path, where, digest)
    if path.count("/") != 1 or path.startswith((".", "/")):
        raise DataError(f"{escaped(path)}: no such file (and not a hub data set name of the form owner/name)")
    check_hub_answers(path, "dataset", path, DataError)
    try:
        dataset = datasets.load_dataset(path, split=split)
    except Exception as err:
        raise DataError(f"{escaped(path)}: cannot load hub data set (offline or not found): "
                        f"{first_line(err)}") from None
    return Rows(dataset, path, lambda i: f"{escaped(path)}[{split}] row {i}",
                f"hub:{path}:{split}:{dataset._fingerprint}")


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
        raise DataError(f"{escaped(path)}: no rows (the file is empty or blank)")
    return rows


def json_row(path: Path, number: int, line: str) -> dict:
    """Line `number` of a JSON lines file as a row: a JSON object with at least one field, else DataError naming
    the line."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = ord(line[err.start]) - 0xDC00  # surrogateescape keeps the raw byte
        raise DataError(f"{escaped(path)}:{number}: not UTF-8 text (byte {byte:#04x} at column "
                        f"{err.start + 1})") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{escaped(path)}:{number}: invalid JSON ({err.msg})") from None
    except RecursionError:
        raise DataError(f"{escaped(path)}:{number}: invalid JSON (nested too deeply)") from None
    if not isinstance(row, dict):
        raise DataError(f"{escaped(path)}:{number}: each line must be a JSON object, got {type(row).__name__}")
    if not row:  # the JSON reader silently drops `{}` beside a list-valued field
        raise DataError(f"{escaped(path)}:{number}: an empty row ({{}}): give it the data format's fields or remove it")
    return row


def _check_json_document(path: Path) -> None:
    """A .json file holds one array (or object) of rows, or one object per line. Checked before
    datasets reads it: datasets 5.2 with pyarrow 26 kills the process on a file holding `null`."""
    check_utf8(path)
    text = path.read_text(encoding="utf-8-sig")
    try:
        document = json.loads(text)
    except RecursionError:
        raise DataError(f"{escaped(path)}: invalid JSON (nested too deeply)") from None
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and "\n" not in text[: err.pos].strip():  # JSON lines under a .json name
            _check_json_lines(path)
            return
        raise DataError(f"{escaped(path)}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(document, (list, dict)):
        raise DataError(f"{escaped(path)}: a .json file must hold an array of rows, got {type(document).__name__}")


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
                    f"{escaped(path)}:{number}: not UTF-8 text (byte {line[err.start]:#04x} at column {err.start + 1})"
                ) from None


def _row_locator(path: Path) -> Callable[[int], str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        lines = [n for n, _ in json_lines(path)]
        return lambda i: f"{escaped(path)}:{lines[i]}" if i < len(lines) else f"{escaped(path)} row {i}"
    if suffix == ".csv":
        return lambda i: f"{escaped(path)}:{i + 2}"  # header is line 1
    return lambda i: f"{escaped(path)} record {i}"


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

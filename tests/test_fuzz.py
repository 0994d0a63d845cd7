"""Property-based fuzzing of every way bad input gets in: recipes, overrides, data files and the CLI.

The property is always the same: the input is accepted, or it is refused with one error the user can
act on (RecipeError naming the field path or the file, DataError naming the file and line). Any other
exception is a bug.

CLI decision: `workbench validate|show` returns 0, 1 or 2. argparse's own usage errors (an unknown
flag, no recipe) leave through SystemExit(2) after printing the usage line, and -h/--help through
SystemExit(0); that is argparse's documented contract, which the console script turns into the same
exit codes, so it is accepted here. Any other exception escaping `main` is a bug.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from workbench import DataError, Recipe, RecipeError
from workbench.data.prepared import prepare_data
from workbench.data.tokens import check_row, tokenize_row
from workbench.frontends.cli import main
from workbench.spec.formats import FORMATS as REGISTRY
from workbench.spec.formats import FORMAT_NAMES
from workbench.spec.recipe import DataSection

ROOT = Path(__file__).resolve().parents[1]


def fuzz(examples: int):
    """Bounded: the whole file runs in well under a minute on two busy cores, the same examples every time (a
    suite's verdict must not depend on the draw). WORKBENCH_FUZZ_SCALE=20 runs twenty times as many examples,
    freshly drawn each time, for a longer hunt."""
    scale = int(os.environ.get("WORKBENCH_FUZZ_SCALE", "1"))
    return settings(max_examples=examples * scale, deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=scale == 1, database=None if scale == 1 else settings.default.database)


FORMATS = list(FORMAT_NAMES)  # every format the registry declares
_names = itertools.count()


# -- the schema, walked from Recipe.model_fields ------------------------------------------------


def _nested_model(annotation):
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _schema_paths(model=Recipe, prefix=""):
    for name, field in model.model_fields.items():
        yield prefix + name
        nested = _nested_model(field.annotation)
        if nested is not None:
            yield from _schema_paths(nested, f"{prefix}{name}.")


def _literals(annotation):
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [v for arg in get_args(annotation) for v in _literals(arg)]


def _schema_literals(model=Recipe):
    for field in model.model_fields.values():
        yield from _literals(field.annotation)
        nested = _nested_model(field.annotation)
        if nested is not None:
            yield from _schema_literals(nested)


SCHEMA_PATHS = sorted(set(_schema_paths()))
TOP_FIELDS = sorted(Recipe.model_fields)
FIELD_NAMES = sorted({p.rsplit(".", 1)[-1] for p in SCHEMA_PATHS})
LITERALS = sorted(set(_schema_literals()), key=repr)
assert "training.lr" in SCHEMA_PATHS and "distributed.deepspeed.stage" in SCHEMA_PATHS

# -- value strategies ---------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.integers(), st.floats(),
    st.sampled_from(LITERALS + ["all-linear", "builtin:tiny", "runs/{name}", "", "q_proj", "1e-4"]),
    st.text(max_size=12),
)
KEYS = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8), st.integers(-2, 2))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                      max_leaves=8)
SECTIONS = st.dictionaries(st.sampled_from(FIELD_NAMES) | KEYS, VALUES, max_size=4)
DOCUMENTS = st.one_of(
    st.dictionaries(st.sampled_from(TOP_FIELDS) | KEYS, SECTIONS | VALUES, max_size=5),
    VALUES,  # mostly not mappings
)
YAML_FRAGMENTS = [
    "training:", "adapter:", "\n", "  ", "- ", "[", "]", "{", "}", ": ", ", ", "&a ", "*a", "!!int ", "!!float ",
    "!!timestamp ", "!!bool ", "!!binary ", "!!set ", "!!python/object/apply:os.system ", "? ", "|", ">", "'", '"',
    "#", "%YAML 1.1\n", "---\n", "...\n", "\t", "\x00", "\ufeff", "lr", "method", "qlora", "1e-4", ".inf", "null",
    "~", "<<: *a\n", "é", "\u2028",
]
YAML_TEXT = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(YAML_FRAGMENTS) | st.text(max_size=6), max_size=12).map("".join),
)
RAW_VALUES = [
    "", " ", "null", "~", "[q_proj, v_proj]", "[tensorboard]", "[]", "{a: 1}", "{}", "!!int x", "!!bool", "[", "]",
    "{", "1e-4", "-1", "0", "nan", ".inf", "-.inf", "1e999", "é", "\x00", "true", "yes", "'quoted'", "&a [*a]", "*a",
    "x=y", "=", "a: b", "- x",
]
KEY_PATHS = st.one_of(
    st.sampled_from(SCHEMA_PATHS),
    st.sampled_from(SCHEMA_PATHS).map(lambda p: p + ".deeper"),
    st.builds(lambda p, junk: p.rsplit(".", 1)[0] + "." + junk, st.sampled_from(SCHEMA_PATHS), st.text(max_size=5)),
    st.text(max_size=10),
)
RAW = st.one_of(st.sampled_from(RAW_VALUES), st.sampled_from(LITERALS).map(str), st.text(max_size=10),
                st.integers().map(str), st.floats().map(repr))
MALFORMED = ["=x", "a..b=1", "training.lr=", "[", "=", "", "training.lr", " = ", ".=1", "training..lr=2",
             "training.lr.x=1", "training.=1", ".training=1", "é=é", "\x00=\x00", "name.x=1"]
OVERRIDES = st.one_of(st.builds(lambda k, v: f"{k}={v}", KEY_PATHS, RAW), st.sampled_from(MALFORMED),
                      st.text(max_size=15))


# -- what a good RecipeError looks like ---------------------------------------------------------


def printable(text: str) -> str:
    """How messages show a key: escaped when it holds a line break or another control character."""
    return text if text.isprintable() else repr(text)[1:-1]


def _prefixes(key: str):
    parts = key.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def assert_recipe_error_names_the_field(message: str, source: str, roots=(), overrides=(), keys=()):
    """The first problem names the file (syntax, encoding) or a field path rooted at a real key,
    or the override that is malformed. `overrides`: key=value strings; `keys`: dotted keys of a dict."""
    first = message.splitlines()[0] if message else ""
    assert first, "empty error message"
    texts = [o for o in overrides if isinstance(o, str)]
    keys = [o.partition("=")[0].strip() for o in texts] + [o for o in overrides if not isinstance(o, str)] + [*keys]
    if first.startswith("override ") and not first.startswith("override:"):
        quoted = [f"override '{o}':" for o in texts + keys] + [f"override {o!r}:" for o in [*overrides, *keys]]
        assert first.startswith(tuple(quoted)), message
        return
    if ": is not a section, cannot set " in first:
        assert any(first == f"{printable(p)}: is not a section, cannot set {printable(k)}"
                   for k in keys if isinstance(k, str) for p in _prefixes(k)), message
        return
    assert first.startswith(f"{source}:"), message
    rest = first[len(source) + 1:]
    if re.match(r"\d+: (invalid YAML|not UTF-8 text) \(", rest):
        return
    rest = rest.removeprefix(" ")
    if rest.startswith(("invalid YAML (", "a recipe must be a YAML mapping", "cannot read recipe (",
                        "unknown key ''")):  # a top-level key '' has no path to show
        return
    roots = {*TOP_FIELDS, *map(str, roots), *(k.split(".")[0] for k in keys if isinstance(k, str))}
    roots = {printable(r) for r in roots}
    assert any(rest.startswith((f"{root}:", f"{root}.")) for root in roots), message


def assert_round_trips(recipe: Recipe, folder: Path):
    """What `workbench show` prints loads back to the same recipe."""
    path = folder / f"shown{next(_names)}.yaml"
    path.write_text(recipe.to_yaml())
    assert Recipe.load(path) == recipe


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def write(folder: Path, content: str | bytes, suffix: str = ".yaml") -> Path:
    path = folder / f"f{next(_names)}{suffix}"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    return path


def top_keys(text) -> list:
    try:
        doc = yaml.safe_load(text)
    except Exception:
        return []
    return list(doc) if isinstance(doc, dict) else []


def load_or_error(load, *args):
    try:
        return load(*args), None
    except RecipeError as err:
        return None, str(err)


# -- 1. recipes ---------------------------------------------------------------------------------


@fuzz(150)
@given(doc=DOCUMENTS, unicode=st.booleans())
def test_random_recipe_documents(folder, doc, unicode):
    text = yaml.safe_dump(doc, allow_unicode=unicode)
    path = write(folder, text)
    recipe, error = load_or_error(Recipe.load, path)
    if error is not None:  # keys as read back: YAML folds a "\x85" in a key into a space
        assert_recipe_error_names_the_field(error, str(path), roots=top_keys(text))
    else:
        assert isinstance(doc, dict) or doc is None
        assert_round_trips(recipe, folder)


@fuzz(150)
@given(text=YAML_TEXT | st.binary(max_size=40))
def test_random_recipe_text(folder, text):
    path = write(folder, text)
    recipe, error = load_or_error(Recipe.load, path)
    if error is not None:
        assert_recipe_error_names_the_field(error, str(path), roots=top_keys(text))
    else:
        assert_round_trips(recipe, folder)


@fuzz(150)
@given(base=st.sampled_from(["recipes/tiny.yaml", "recipes/tiny-qlora.yaml", ""]),
       overrides=st.lists(OVERRIDES, max_size=4))
def test_random_overrides_through_load(folder, base, overrides):
    path = ROOT / base if base else write(folder, "")
    recipe, error = load_or_error(Recipe.load, path, overrides)
    if error is not None:
        assert_recipe_error_names_the_field(error, str(path), overrides=overrides)
    else:
        assert_round_trips(recipe, folder)


@fuzz(100)
@given(overrides=st.dictionaries(KEY_PATHS | st.integers(), VALUES, max_size=3))
def test_random_dict_overrides_through_load(folder, overrides):
    path = ROOT / "recipes/tiny.yaml"
    recipe, error = load_or_error(Recipe.load, path, overrides)
    if error is not None:
        assert_recipe_error_names_the_field(error, str(path), keys=list(overrides))
    else:
        assert_round_trips(recipe, folder)


IDENTIFIER_KEYS = st.sampled_from(SCHEMA_PATHS).map(lambda p: p.replace(".", "__")) | st.from_regex(
    r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@fuzz(100)
@given(dotlist=st.lists(OVERRIDES, max_size=3), keywords=st.dictionaries(IDENTIFIER_KEYS, VALUES, max_size=2))
def test_random_recipe_override(folder, dotlist, keywords):
    base = Recipe()
    recipe, error = load_or_error(lambda: base.override(*dotlist, **keywords))
    assert base == Recipe()  # the original is never changed
    if error is not None:
        keys = [k.replace("__", ".") for k in keywords]
        assert_recipe_error_names_the_field(error, "override", overrides=dotlist, keys=keys)
    else:
        assert_round_trips(recipe, folder)


DEEP = 3000
LAUGHS = "l0: &a0 [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"l{i}: &a{i} [{','.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))  # 10**10 leaves if expanded


@pytest.mark.parametrize("text", [
    "a: " + "[" * DEEP + "]" * DEEP,
    "a: " + "[" * 450 + "]" * 450,  # deep enough to break a recursive copy, not the YAML parser
    "a:\n" + "".join(" " * i + "b:\n" for i in range(1, 450)),
    "adapter: &x {r: *x}", "distributed: &x {fsdp: *x}", "output: {sample_prompts: &x [*x]}",
    LAUGHS + "model: {dtype: *a9}\n", LAUGHS + "output: {trackers: *a9}\n",
    "a: !!int abc", "a: !!bool", "a: !!timestamp 2020-99-99", "a: !!float", "a: !!python/object/apply:os.system [ls]",
    "false", "0", "[]", "''", "training: {lr: .inf}", "training: {epochs: .nan}",
    b"name: \xff\xfe", "name: x\x00",
], ids=lambda t: repr(t[:24]))
def test_nasty_recipe_texts(folder, text):
    path = write(folder, text)
    with pytest.raises(RecipeError) as err:
        Recipe.load(path)
    assert_recipe_error_names_the_field(str(err.value), str(path), roots=top_keys(text))
    lines = str(err.value).splitlines()
    assert len(lines) <= 25 and max(map(len, lines)) < 500  # aliases must not blow the message up


def test_unreadable_recipe_paths(folder):
    for path in ["no/such/recipe.yaml", "with\x00nul.yaml", str(folder)]:
        with pytest.raises(RecipeError, match="cannot read recipe"):
            Recipe.load(path)


@pytest.mark.parametrize("overrides", [[5], {5: 1}, {"a..b": 1}, ["training.lr=&a [*a]"], ["a..b=1"], [".=1"],
                                       ["training.lr=\n"], ["\n=1"]], ids=repr)
def test_nasty_overrides(overrides):
    with pytest.raises(RecipeError) as err:
        Recipe.load(ROOT / "recipes/tiny.yaml", overrides)
    listed = {"overrides": overrides} if isinstance(overrides, list) else {"keys": list(overrides)}
    assert_recipe_error_names_the_field(str(err.value), str(ROOT / "recipes/tiny.yaml"), **listed)


# -- 2. data ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_env(tmp_path_factory):
    """Tokenized and datasets caches in a temporary folder, not the user's."""
    import datasets

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORA_WORKBENCH_CACHE", str(cache / "workbench"))
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache / "datasets"))
        yield tmp_path_factory.mktemp("data")


JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
TEXT = st.text(max_size=20) | JUNK
ROLES = st.sampled_from(["system", "user", "assistant", "robot", "", "USER"]) | JUNK
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLES, "content": TEXT, "name": JUNK}) | JUNK
GOOD_CHAT = st.builds(lambda q, a: {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]},
                      st.text(max_size=20), st.text(min_size=1, max_size=20))
FIELDS = {name: [*fmt.fields, *fmt.optional] for name, fmt in REGISTRY.items()}
GOOD_PAIR = st.builds(lambda p, c, r: {"prompt": p, "chosen": c, "rejected": r}, st.text(max_size=20),
                      st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
EXTRA = st.dictionaries(st.sampled_from(["id", "source", "meta", "Text", "messages", "text"]), JUNK, max_size=2)


def rows_for(fmt: str):
    if fmt == "chat":
        shaped = st.fixed_dictionaries({}, optional={"messages": st.lists(MESSAGE, max_size=4) | JUNK})
        good = GOOD_CHAT
    elif REGISTRY[fmt].preference:  # texts or message lists in any of its fields
        shaped = st.fixed_dictionaries({}, optional={f: TEXT | st.lists(MESSAGE, max_size=3) for f in FIELDS[fmt]})
        good = GOOD_PAIR | GOOD_PAIR.map(lambda row: {
            "chosen": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["rejected"]}]})
    else:
        shaped = st.fixed_dictionaries({}, optional={f: TEXT for f in FIELDS[fmt]})
        good = st.fixed_dictionaries({f: st.text(min_size=1, max_size=20) for f in FIELDS[fmt]})
    return st.one_of(good, good, st.builds(lambda row, extra: {**extra, **row}, good, EXTRA), shaped,
                     st.dictionaries(st.sampled_from([f for fs in FIELDS.values() for f in fs]) | st.text(max_size=5),
                                     JUNK, max_size=4))


def lines_for(fmt: str):
    row_text = rows_for(fmt).map(json.dumps)
    return st.one_of(
        row_text, row_text, row_text,
        JUNK.map(json.dumps),  # lists, numbers, null, strings
        st.sampled_from(["", "   ", "\t", "\x1c", "\ufeff{}", "{", "}", "[]", "NaN", '{"text": NaN}',
                         '{"text": "\\ud800"}', '{"messages": "\\udfff"}', '{"text": "a", "text": 1}',
                         '{"text": 1, "text": "a"}', '{"x": ' + "[" * 70 + "]" * 70 + "}",
                         '{"x": ' + "[" * 3000 + "]" * 3000 + "}", '{"text": "a"}\r{"text": "b"}']),
        st.builds(lambda row, cut: row[:cut], row_text, st.integers(1, 30)),  # truncated JSON
        st.text(max_size=20),
        st.binary(max_size=8),  # usually not UTF-8
    )


def _physical_lines(raw: bytes) -> list[str]:
    """Lines as Python's text files (and pyarrow) split them: \\n, \\r\\n or \\r."""
    return list(io.StringIO(raw.decode("utf-8", "surrogateescape"), newline=None))


def _blank(line: str) -> bool:
    return not line.strip(" \t\r\n")


def first_bad_json_line(raw: bytes) -> int | None:
    """The oracle: the first line that is not UTF-8, not a JSON object, or an empty one."""
    for number, line in enumerate(_physical_lines(raw), start=1):
        if _blank(line):
            continue
        try:
            line.encode("utf-8")
            row = json.loads(line)
        except (UnicodeEncodeError, ValueError, RecursionError):
            return number
        if not isinstance(row, dict) or not row:
            return number
    return None


def prepare(path: Path, fmt: str, tokenizer):
    try:
        return prepare_data(DataSection(train=str(path), format=fmt, max_seq_len=64), tokenizer), None
    except DataError as err:
        return None, str(err)


def assert_data_error_names_the_line(error: str, path: Path, nonblank: set[int]):
    match = re.match(rf"{re.escape(str(path))}:(\d+): ", error)
    if match:
        assert int(match[1]) in nonblank, error
    else:  # only file-wide problems may skip the line
        assert error.startswith(f"{path}: "), error
        assert any(reason in error for reason in ("no rows", "no training sample has a target token",
                                                  "every sample loses its whole answer to truncation",
                                                  "a source needs at least 2 rows")), error


@pytest.mark.parametrize("fmt", FORMATS)
@fuzz(25)
@given(data=st.data())
def test_random_jsonl_files(data_env, tiny_tokenizer, fmt, data):
    lines = data.draw(st.lists(lines_for(fmt), max_size=6), label="lines")
    newline = data.draw(st.sampled_from([b"\n", b"\r\n"]), label="newline")
    raw = newline.join(line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass") for line in lines)
    raw += data.draw(st.sampled_from([b"", newline]), label="end")
    path = write(data_env, raw, ".jsonl")
    prepared, error = prepare(path, fmt, tiny_tokenizer)
    physical = _physical_lines(raw)
    nonblank = {n for n, line in enumerate(physical, start=1) if not _blank(line)}
    bad = first_bad_json_line(raw)
    if bad is not None:
        assert error is not None and error.startswith(f"{path}:{bad}: "), (bad, error)
    elif error is not None:
        assert_data_error_names_the_line(error, path, nonblank)
    else:
        assert prepared.stats["train_samples"] == len(nonblank)


@pytest.mark.parametrize("fmt", FORMATS)
@fuzz(150)
@given(data=st.data())
def test_random_rows_check_and_tokenize(tiny_tokenizer, fmt, data):
    """The row checks alone, on every kind of value a data set can hand them."""
    row = data.draw(rows_for(fmt) | st.dictionaries(st.text(max_size=5), JUNK, max_size=3), label="row")
    where = "data.jsonl:7"
    try:
        check_row(row, fmt, where)
    except DataError as err:
        assert str(err).startswith(f"{where}: "), str(err)
        with pytest.raises(DataError, match=f"^{where}: "):
            tokenize_row(row, tiny_tokenizer, DataSection(format=fmt, max_seq_len=64), where)
        return
    out = tokenize_row(row, tiny_tokenizer, DataSection(format=fmt, max_seq_len=64), where)
    assert len(out["input_ids"]) == len(out["labels"]) <= 64 * REGISTRY[fmt].sequences_per_example


CELLS = st.one_of(st.text(max_size=12), st.integers().map(str), st.sampled_from(["", "NaN", "null", '"', ",", "\n"]))
CSV_NAMES = st.sampled_from(sorted({f for fields in FIELDS.values() for f in fields} | {"x"}))


@fuzz(25)
@given(header=st.lists(CSV_NAMES | st.text(max_size=5), min_size=1, max_size=3),
       rows=st.lists(st.lists(CELLS, max_size=4), max_size=4), fmt=st.sampled_from(FORMATS),
       garbage=st.none() | st.binary(max_size=30) | st.text(max_size=30))
def test_random_csv_files(data_env, tiny_tokenizer, header, rows, fmt, garbage):
    if garbage is None:
        buffer = io.StringIO()
        csv.writer(buffer).writerows([header, *rows])
        content = buffer.getvalue()
    else:
        content = garbage
    path = write(data_env, content, ".csv")
    prepared, error = prepare(path, fmt, tiny_tokenizer)
    if error is not None:
        raw = path.read_bytes()
        match = re.match(rf"{re.escape(str(path))}:(\d+): ", error)
        if match:
            assert 1 <= int(match[1]) <= max(len(_physical_lines(raw)), 2), error
        else:
            assert error.startswith(f"{path}: "), error


@fuzz(20)
@given(value=st.one_of(st.lists(rows_for("text") | JUNK, max_size=4), rows_for("text"), JUNK),
       garbage=st.none() | st.binary(max_size=20))
def test_random_json_files(data_env, tiny_tokenizer, value, garbage):
    path = write(data_env, json.dumps(value) if garbage is None else garbage, ".json")
    prepared, error = prepare(path, "text", tiny_tokenizer)
    if error is not None:
        assert re.match(rf"{re.escape(str(path))}(:\d+| record \d+)?: ", error), error


@pytest.mark.parametrize("content, message", [
    ('{"text": "a"}\n{"text": "\\ud800"}\n', r":2: a string holds an unpaired surrogate"),
    ('{"text": "a"}\n{"text": 1, "text": "a"}\n{"text": "a", "text": 1}\n', r":3: field 'text' "),
    ('{"text": "a"}\n{"x": ' + "[" * 70 + "]" * 70 + "}\n", r":2: nested 71 levels deep"),
    ('{"text": "a"}\n{"x": ' + "[" * 3000 + "]" * 3000 + "}\n", r":2: invalid JSON \(nested too deeply\)"),
    (b'{"text": "a"}\n{"text": "\xff"}\n', r":2: not UTF-8 text \(byte 0xff"),
    ('{"text": "a"}\n\x1c\n', r":2: invalid JSON"),
    ('\ufeff{"text": "a"}\n', r":1: invalid JSON"),
    ("\n \n\t\n", r": no rows"),
])
def test_nasty_jsonl_files(data_env, tiny_tokenizer, content, message):
    path = write(data_env, content, ".jsonl")
    with pytest.raises(DataError, match=re.escape(str(path)) + message):
        prepare_data(DataSection(train=str(path), format="text", max_seq_len=64), tiny_tokenizer)


def test_nasty_csv_and_folder(data_env, tiny_tokenizer):
    path = write(data_env, b"text\nfine\n\xff\xfe\n", ".csv")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: not UTF-8 text")):
        prepare_data(DataSection(train=str(path), format="text"), tiny_tokenizer)
    folder = data_env / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match="is a folder"):
        prepare_data(DataSection(train=str(folder), format="text"), tiny_tokenizer)


# -- 3. the CLI ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "bad.yaml").write_text("training: {lrr: 1}\n")
    (folder / "syntax.yaml").write_text("training: [\n")
    (folder / "bytes.yaml").write_bytes(b"\xff\xfe")
    return [str(ROOT / "recipes/tiny.yaml"), str(folder / "bad.yaml"), str(folder / "syntax.yaml"),
            str(folder / "bytes.yaml"), str(folder / "missing.yaml"), str(folder)]


@fuzz(60)
@given(data=st.data())
def test_cli_validate_and_show_random_arguments(cli_files, data):
    flags = ["--json", "--foo", "-x", "--", "-", "--resume", "--help", "-h", "--nproc=2"]
    argument = st.one_of(st.sampled_from(cli_files), st.sampled_from(cli_files), OVERRIDES, st.sampled_from(flags),
                         st.text(max_size=10))
    argv = [data.draw(st.sampled_from(["validate", "show"]), label="command"),
            *data.draw(st.lists(argument, max_size=4), label="args")]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse: usage error (2) or help (0)
            assert exit_.code in (0, 2), (argv, exit_.code)
            assert exit_.code == 2 or {"-h", "--help"} & set(argv), argv
            return
    assert type(code) is int and code in (0, 1, 2), (argv, code)
    assert "Traceback" not in err.getvalue()
    if code:
        assert err.getvalue().startswith("error: "), err.getvalue()

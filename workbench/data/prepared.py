"""The prepared data set: every source tokenized (cached by content and tokenizer), mixed by weight, held out,
checked that something trains, and packed: several samples per row, positions restarting at 0, so that
transformers builds a block-diagonal causal mask and a sample attends only to itself."""

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
from workbench.base.builtin import cache_dir
from workbench.base.errors import DataError
from workbench.data.rows import Rows, load_rows
from workbench.data.tokens import check_row, tokenize_row
from workbench.spec.formats import format_of
from workbench.spec.recipe import DataSection

PIPELINE_VERSION = "3"  # bump when tokenization output changes, to invalidate caches


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
        return mix_fingerprint([(d.rows.fingerprint, d.source) for d in self.sources])


def mix_fingerprint(sources: list[tuple[str, Any]]) -> str:
    """The content hash of a mix: each source's file hash with its format and weight."""
    parts = [f"{digest}|{source.format}|{source.weight!r}" for digest, source in sources]
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

"""The data as the model will see it, before any weights load: the first rows rendered with the chat template
applied and the trained tokens marked, token lengths, what truncation costs, and how well packing fills rows.

It reads the recipe's data exactly as training does (workbench/data/pipeline.py: the same rows, checks, tokenization
and packing, and the same on-disk cache, so a preview also prepares the run's tokenized data).
"""

from __future__ import annotations

import html
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from workbench.base.errors import DataError, RecipeError, printable
from workbench.base.quiet import leaves_the_process_as_found, quiet_libraries
from workbench.data import streaming
from workbench.data.prepared import check_trainable, drop_empty, pack, tokenize_data, whole_training_examples
from workbench.data.tokens import IGNORE, tokenize_pair, tokenize_row
from workbench.model.loading import load_tokenizer
from workbench.spec.formats import format_of
from workbench.spec.recipe import Recipe

HISTOGRAM_BINS = 30


@dataclass
class Sample:
    """One sequence of a row: (text, trained) spans in order, as the tokenizer cut them."""

    label: str  # "" for a plain row; "chosen" / "rejected" for a preference pair; "desirable" / "undesirable"
    spans: list[tuple[str, bool]]
    tokens: int
    targets: int
    truncated: bool
    left_out: bool = False  # training leaves the row out (no answer left, or a pair truncation made equal)
    scored: bool = False  # a reward model's sequence: its reward is read at the marked last token, nothing trained

    def to_json(self) -> dict:
        return {"label": self.label, "spans": [[text, trained] for text, trained in self.spans],
                "tokens": self.tokens, "targets": self.targets, "truncated": self.truncated,
                "left_out": self.left_out, "scored": self.scored}

    def title(self, where: str) -> str:
        marked = "reward read at its last token" if self.scored else f"{self.targets} trained"
        return (f"{where}{f' ({self.label})' if self.label else ''}: {self.tokens} tokens, {marked}"
                f"{', truncated' if self.truncated else ''}{' (left out of training)' if self.left_out else ''}")


@dataclass
class DataPreview:
    source: str
    format: str
    max_seq_len: int
    rows: list[tuple[str, list[Sample]]]  # (file:line, its samples) for the first rows
    lengths: list[int]  # tokens of every sequence as trained (after truncation; a pair is two)
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"source": self.source, "format": self.format, "max_seq_len": self.max_seq_len,
                "stats": self.stats, "lengths": self.lengths,
                "rows": [{"where": where, "samples": [s.to_json() for s in samples]} for where, samples in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> "DataPreview":
        """The preview `workbench data --json` printed (the UI runs the command in its workspace)."""
        rows = [(row["where"], [Sample(s["label"], [(text, bool(trained)) for text, trained in s["spans"]],
                                       s["tokens"], s["targets"], s["truncated"], s.get("left_out", False),
                                       s.get("scored", False))
                                for s in row["samples"]]) for row in data["rows"]]
        return cls(data["source"], data["format"], data["max_seq_len"], rows, data["lengths"], data["stats"])

    def summary_lines(self) -> list[str]:
        s = self.stats
        trained = (f"{s['target_tokens']:,} of them scored ({s['scored']}: a reward model)" if s.get("scored")
                   else f"{s['target_tokens']:,} of them trained ({s['target_fraction']:.0%})")
        rows = f"the first {s['rows']} rows (a stream: read as it trains)" if s.get("streamed") else f"{s['rows']} rows"
        lines = [f"{self.source}: {rows} ({self.format}), {s['tokens']:,} tokens, {trained}",
                 f"tokens per sequence: median {s['median_length']}, max {s['max_length']} "
                 f"(max_seq_len {self.max_seq_len})",
                 f"rows truncated at max_seq_len: {s['truncated']} ({s['truncated_fraction']:.1%}); rows left out of "
                 f"training (truncation took their answer{' or made the pair equal' if s.get('pairs') else ''}"
                 f"): {s['lost_answer']}" + (f", pairs cut by truncation (a reward model scores whole answers): "
                                              f"{s['train_cut']}" if s.get("scored") else "")]
        for part in s.get("mix", []):
            lines.append(f"  {part['path']} ({part['format']}): {part['rows']} rows, weight {part['weight']:g} -> "
                         f"{part['samples']} samples ({part['samples'] / max(s['rows'], 1):.0%} of the mix)")
        if s.get("packed_rows") is not None:
            lines.append(f"packing: {s['examples']} examples into {s['packed_rows']} rows of {s['row_len']} tokens, "
                         f"{s['packing_efficiency']:.1%} of each row used")
        else:
            lines.append(f"packing off: {s['examples']} examples, each padded to the longest of its batch")
        if s.get("eval_rows") is not None:
            lines.append(f"held out for evaluation ({s['eval_source']}): {s['eval_rows']} rows, {s['eval_tokens']:,} "
                         "tokens")
        return lines

    def to_text(self, width: int = 100) -> str:
        """Plain text: trained spans between ⟦ and ⟧ (the command line colours them instead), control
        characters of the data shown, not sent to the terminal."""
        out = [*map(printable, self.summary_lines()), ""]
        for where, samples in self.rows:
            for sample in samples:
                title = f"── {printable(sample.title(where))} "
                out.append(title + "─" * max(0, width - len(title)))
                out.append("".join(f"⟦{printable(text)}⟧" if trained else printable(text)
                                   for text, trained in sample.spans))
        return "\n".join(out)

    def to_html(self, summary: bool = True) -> str:
        """Every text escaped: rows come from user files and are shown in a browser."""
        parts = ['<div class="wb-data-preview">']
        if summary:
            parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in self.summary_lines()) + "</ul>")
        for where, samples in self.rows:
            for sample in samples:
                parts.append(f'<div class="wb-sample"><div class="wb-sample-title">{html.escape(sample.title(where))}'
                             '</div><pre class="wb-sample-text">')
                parts += [f'<mark class="wb-trained">{html.escape(text)}</mark>' if trained
                          else f'<span class="wb-masked">{html.escape(text)}</span>' for text, trained in sample.spans]
                parts.append("</pre></div>")
        parts.append("</div>")
        return "".join(parts)

    def _repr_html_(self) -> str:
        return self.to_html()

    def histogram(self):
        """A matplotlib Figure of the token lengths, with max_seq_len marked."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 2.6), layout="constrained")
        ax = fig.add_subplot()
        if self.lengths:
            ax.hist(self.lengths, bins=min(HISTOGRAM_BINS, max(1, len(set(self.lengths)))), color="#4c72b0")
        ax.axvline(self.max_seq_len, color="#c44e52", linestyle="--", label=f"max_seq_len {self.max_seq_len}")
        ax.set_xlabel("tokens per sequence (after truncation)")
        ax.set_ylabel("sequences")
        ax.legend(loc="upper left", fontsize=8)
        return fig


@leaves_the_process_as_found
def preview_data(recipe: Recipe | dict | str | Path, rows: int = 3) -> DataPreview:
    """The recipe's training data as the model will see it (see the module's docstring): the first `rows` rows
    rendered, and the figures of every row training will read (data.limit and data.eval_split applied)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise RecipeError(f"rows: a whole number of rows to show, 0 or more; got {rows!r}")
    quiet_libraries()
    if isinstance(recipe, dict):
        recipe = Recipe.from_dict(recipe)
    elif not isinstance(recipe, Recipe):
        recipe = Recipe.load(recipe)
    cfg = recipe.data
    fmt = format_of(cfg.format)
    scores = recipe.training.scores_sequences  # a reward model reads one position per sequence, not its answer
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    # the split training makes; of a stream, its opening (streaming.PREVIEW_ROWS rows), never the whole source
    data = (streaming.opening(cfg, tokenizer) if cfg.streaming
            else tokenize_data(cfg, tokenizer, seed=recipe.training.seed))
    with _of_the_opening(cfg, len(data.train)):
        check_trainable(data.train, cfg)  # what training refuses, the preview refuses
    shown = []
    for source in data.sources:  # the first rows of each source, each rendered with its own format
        for i in range(min(rows, len(source.rows.dataset), cfg.limit if cfg.limit is not None else rows)):
            where = source.rows.where(i)
            shown.append((where, _samples(source.rows.dataset[i], tokenizer, source.cfg, where, scores)))
    lengths = _sequence_lengths(data.train, fmt.sequences_per_example > 1)
    stats = _stats(data.train, lengths, cfg, fmt)
    if scores:  # what a reward model trains on: whole pairs only (data.prepare_data's whole_only), one score each
        with _of_the_opening(cfg, len(data.train)):  # (what training refuses, this refuses)
            kept, cut = whole_training_examples(drop_empty(data.train), cfg)
        scored = _sequence_lengths(kept, True)
        packing = {k: v for k, v in _stats(kept, scored, cfg, fmt).items()
                   if k in ("examples", "packed_rows", "row_len", "packing_efficiency")}
        stats.update(packing, train_cut=cut, target_tokens=len(scored),
                     target_fraction=len(scored) / max(sum(lengths), 1), scored="the last token of each sequence")
    if len(data.sources) > 1:
        stats["mix"] = data.mix
    if cfg.streaming:
        stats["streamed"] = True
    if data.eval is not None:
        stats.update(eval_source=str(cfg.eval) if cfg.eval else f"data.eval_split {cfg.eval_split}",
                     eval_rows=len(data.eval), eval_tokens=sum(len(ids) for ids in data.eval["input_ids"]))
    formats = "+".join(dict.fromkeys(source.source.format for source in data.sources))
    return DataPreview(cfg.train_name, formats, cfg.max_seq_len, shown, lengths, stats)


@contextmanager
def _of_the_opening(cfg, read: int):
    """A refusal of a stream's opening says so: training reads on past rows a preview has to stop at."""
    try:
        yield
    except DataError as err:
        if not cfg.streaming:
            raise
        raise DataError(f"{err} (in the first {read} rows of the stream, all a preview reads; a run reads on past "
                        "them)") from None


def _sequence_lengths(tokenized, two_samples: bool) -> list[int]:
    """Tokens per sequence as trained: a preference pair, or an unpaired row with its KL sample, counts as its
    two sequences (each is cut at max_seq_len on its own)."""
    if not two_samples:
        return [len(ids) for ids in tokenized["input_ids"]]
    lengths = []
    for positions in tokenized["position_ids"]:
        split = positions.index(0, 1)
        lengths += [split, len(positions) - split]
    return lengths


def _samples(row: dict, tokenizer, cfg, where: str, scores: bool = False) -> list[Sample]:
    fmt = format_of(cfg.format)
    if fmt.unpaired:  # the answer as labelled; its KL sample (another row's answer) is not learned from
        sample = tokenize_row(row, tokenizer, cfg, where)
        answer = {key: sample[key][:sample["position_ids"].index(0, 1)] for key in ("input_ids", "labels")}
        label = "desirable" if sample["desirable"][0] else "undesirable"
        return [_sample(label, {**sample, **answer}, tokenizer, left_out=sample["targets"] == 0)]
    if not fmt.preference:
        sample = tokenize_row(row, tokenizer, cfg, where)
        return [_sample("", sample, tokenizer, left_out=sample["targets"] == 0)]
    chosen, rejected = tokenize_pair(row, tokenizer, cfg, where)
    left_out = not (chosen["targets"] and rejected["targets"]) or chosen["labels"] == rejected["labels"]
    if scores:  # a reward model: the pair trains whole or not at all
        left_out = left_out or chosen["truncated"] or rejected["truncated"]
        chosen, rejected = _last_token_scored(chosen), _last_token_scored(rejected)
    pair = [_sample("chosen", chosen, tokenizer, left_out), _sample("rejected", rejected, tokenizer, left_out)]
    for sample in pair:
        sample.scored = scores
    return pair


def _last_token_scored(sample: dict) -> dict:
    """A reward model's view of a sequence: its reward is read at its last token, everything before is context
    (objectives.sequence_rewards); a truncated sequence is scored nowhere (its pair is left out)."""
    ids = sample["input_ids"]
    labels = [IGNORE] * len(ids)
    if ids and not sample["truncated"]:
        labels[-1] = ids[-1]
    return {**sample, "labels": labels, "targets": int(labels[-1] != IGNORE) if ids else 0}


def _sample(label: str, sample: dict, tokenizer, left_out: bool) -> Sample:
    """Consecutive tokens of the same kind decoded together (one token alone can be half a character)."""
    ids, labels = sample["input_ids"], sample["labels"]
    spans: list[tuple[str, bool]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (labels[end] != IGNORE) != (labels[start] != IGNORE):
            spans.append((tokenizer.decode(ids[start:end]), labels[start] != IGNORE))
            start = end
    return Sample(label, spans, len(ids), sample["targets"], sample["truncated"], left_out)


def _stats(tokenized, lengths: list[int], cfg, fmt) -> dict:
    ordered = sorted(lengths)
    targets = tokenized["targets"]
    count = len(targets)
    stats = {"rows": count, "sequences": len(ordered), "tokens": sum(ordered), "target_tokens": sum(targets),
             "target_fraction": sum(targets) / max(sum(ordered), 1),
             "median_length": ordered[len(ordered) // 2] if ordered else 0, "max_length": ordered[-1] if ordered else 0,
             "truncated": sum(tokenized["truncated"]), "truncated_fraction": sum(tokenized["truncated"]) / max(count, 1),
             "lost_answer": sum(1 for t in targets if t == 0), "pairs": fmt.preference}
    kept = drop_empty(tokenized)
    stats["examples"] = len(kept)
    if cfg.packing:
        row_len = cfg.max_seq_len * fmt.sequences_per_example
        packed = pack(kept, row_len)
        used = sum(len(ids) for ids in kept["input_ids"])
        stats.update(packed_rows=len(packed), row_len=row_len, packing_efficiency=used / (len(packed) * row_len))
    else:
        stats.update(packed_rows=None)
    return stats

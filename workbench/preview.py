"""The data as the model will see it, before any weights load: the first rows rendered with the chat template
applied and the trained tokens marked, token lengths, what truncation costs, and how well packing fills rows.

It reads the recipe's data exactly as training does (workbench/data.py: the same rows, checks, tokenization
and packing, and the same on-disk cache, so a preview also prepares the run's tokenized data).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from .data import IGNORE, check_row, load_rows, pack, tokenize_row, tokenize_rows
from .formats import format_of
from .quiet import leaves_the_process_as_found
from .recipe import Recipe

HISTOGRAM_BINS = 30


@dataclass
class Sample:
    """One sequence of a row: (text, trained) spans in order, as the tokenizer cut them."""

    label: str  # "" for a plain row; "chosen" / "rejected" for a preference pair
    spans: list[tuple[str, bool]]
    tokens: int
    targets: int
    truncated: bool

    def to_json(self) -> dict:
        return {"label": self.label, "spans": [[text, trained] for text, trained in self.spans],
                "tokens": self.tokens, "targets": self.targets, "truncated": self.truncated}


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

    def summary_lines(self) -> list[str]:
        s = self.stats
        lines = [f"{self.source}: {s['rows']} rows ({self.format}), {s['tokens']:,} tokens, "
                 f"{s['target_tokens']:,} of them trained ({s['target_fraction']:.0%})",
                 f"tokens per sequence: median {s['median_length']}, max {s['max_length']} "
                 f"(max_seq_len {self.max_seq_len})",
                 f"rows truncated at max_seq_len: {s['truncated']} ({s['truncated_fraction']:.1%}); rows that lost their "
                 f"whole answer (left out of training): {s['lost_answer']}"]
        if s.get("packed_rows") is not None:
            lines.append(f"packing: {s['examples']} examples into {s['packed_rows']} rows of {s['row_len']} tokens, "
                         f"{s['packing_efficiency']:.1%} of each row used")
        else:
            lines.append(f"packing off: {s['examples']} rows padded to the longest of each batch")
        return lines

    def to_text(self, width: int = 100) -> str:
        """Plain text: trained spans between ⟦ and ⟧ (the command line colours them instead)."""
        out = [*self.summary_lines(), ""]
        for where, samples in self.rows:
            for sample in samples:
                title = f"── {where}{f' ({sample.label})' if sample.label else ''}: {sample.tokens} tokens, " \
                        f"{sample.targets} trained{', truncated' if sample.truncated else ''} "
                out.append(title + "─" * max(0, width - len(title)))
                out.append("".join(f"⟦{text}⟧" if trained else text for text, trained in sample.spans))
        return "\n".join(out)

    def to_html(self, summary: bool = True) -> str:
        """Every text escaped: rows come from user files and are shown in a browser."""
        parts = ['<div class="wb-data-preview">']
        if summary:
            parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in self.summary_lines()) + "</ul>")
        for where, samples in self.rows:
            for sample in samples:
                label = f" ({html.escape(sample.label)})" if sample.label else ""
                parts.append(f'<div class="wb-sample"><div class="wb-sample-title">{html.escape(where)}{label}: '
                             f'{sample.tokens} tokens, {sample.targets} trained'
                             f'{", truncated" if sample.truncated else ""}</div><pre class="wb-sample-text">')
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
        ax.hist(self.lengths, bins=min(HISTOGRAM_BINS, max(1, len(set(self.lengths)))), color="#4c72b0")
        ax.axvline(self.max_seq_len, color="#c44e52", linestyle="--", label=f"max_seq_len {self.max_seq_len}")
        ax.set_xlabel("tokens per sequence (after truncation)")
        ax.set_ylabel("sequences")
        ax.legend(loc="upper left", fontsize=8)
        return fig


@leaves_the_process_as_found
def preview_data(recipe: Recipe | str | Path, rows: int = 3) -> DataPreview:
    """The recipe's training data as the model will see it (see the module's docstring)."""
    from .models import load_tokenizer
    from .quiet import quiet_libraries

    quiet_libraries()
    recipe = recipe if isinstance(recipe, Recipe) else Recipe.load(recipe)
    cfg = recipe.data
    fmt = format_of(cfg.format)
    tokenizer = load_tokenizer(recipe.model)
    source = load_rows(cfg.train, cfg.split, lambda row, where: check_row(row, cfg.format, where))
    shown = []
    for i in range(min(max(rows, 0), len(source.dataset))):
        where = source.where(i)
        example = tokenize_row(source.dataset[i], tokenizer, cfg, where)
        shown.append((where, _samples(example, tokenizer, fmt.preference)))
    tokenized, _ = tokenize_rows(source, tokenizer, cfg, cfg.limit)
    lengths = _sequence_lengths(tokenized, fmt.preference)
    return DataPreview(str(cfg.train), cfg.format, cfg.max_seq_len, shown, lengths, _stats(tokenized, lengths, cfg, fmt))


def _sequence_lengths(tokenized, preference: bool) -> list[int]:
    """Tokens per sequence as trained: a preference pair counts as its two sequences (each is cut at
    max_seq_len on its own)."""
    if not preference:
        return [len(ids) for ids in tokenized["input_ids"]]
    lengths = []
    for positions in tokenized["position_ids"]:
        split = positions.index(0, 1)
        lengths += [split, len(positions) - split]
    return lengths


def _samples(example: dict, tokenizer, preference: bool) -> list[Sample]:
    ids, labels = example["input_ids"], example["labels"]
    if not preference:
        return [_sample("", ids, labels, tokenizer, example["truncated"])]
    split = example["position_ids"].index(0, 1)  # the rejected answer's positions restart at 0
    return [_sample("chosen", ids[:split], labels[:split], tokenizer, example["truncated"]),
            _sample("rejected", ids[split:], labels[split:], tokenizer, example["truncated"])]


def _sample(label: str, ids: list[int], labels: list[int], tokenizer, truncated: bool) -> Sample:
    """Consecutive tokens of the same kind decoded together (one token alone can be half a character)."""
    spans: list[tuple[str, bool]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (labels[end] != IGNORE) != (labels[start] != IGNORE):
            spans.append((tokenizer.decode(ids[start:end]), labels[start] != IGNORE))
            start = end
    targets = sum(1 for label in labels[1:] if label != IGNORE)
    return Sample(label, spans, len(ids), targets, truncated)


def _stats(tokenized, lengths: list[int], cfg, fmt) -> dict:
    ordered = sorted(lengths)
    targets = tokenized["targets"]
    count = len(targets)
    stats = {"rows": count, "sequences": len(ordered), "tokens": sum(ordered), "target_tokens": sum(targets),
             "target_fraction": sum(targets) / max(sum(ordered), 1),
             "median_length": ordered[len(ordered) // 2] if ordered else 0, "max_length": ordered[-1] if ordered else 0,
             "truncated": sum(tokenized["truncated"]), "truncated_fraction": sum(tokenized["truncated"]) / max(count, 1),
             "lost_answer": sum(1 for t in targets if t == 0)}
    kept = tokenized.select([i for i, t in enumerate(targets) if t > 0])
    stats["examples"] = len(kept)
    if cfg.packing and len(kept):
        row_len = cfg.max_seq_len * fmt.sequences_per_example
        packed = pack(kept, row_len)
        used = sum(len(ids) for ids in kept["input_ids"])
        stats.update(packed_rows=len(packed), row_len=row_len, packing_efficiency=used / (len(packed) * row_len))
    else:
        stats.update(packed_rows=None)
    return stats

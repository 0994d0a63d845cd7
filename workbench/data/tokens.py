"""A row to token ids: rendered with its format (and the chat template), prompts masked from the loss,
truncated to data.max_seq_len; a preference pair or an unpaired row becomes two samples in one example.

Every example is `input_ids`, `labels` (IGNORE where no loss is taken) and `position_ids`. A sample starts wherever
positions do not continue; a preference pair may hold its prompt once, its rejected answer's positions
continuing the prompt (`shared_prompt_layout`; the CPU's per-sample attention reads it)."""

from __future__ import annotations

import json

from workbench.base.errors import DataError
from workbench.data.rows import first_line
from workbench.spec import formats
from workbench.spec.chat_templates import TemplateBudgetError, TemplateFailure, render_ids
from workbench.spec.formats import format_of
from workbench.spec.recipe import DataSection

IGNORE = -100


def check_row(row: dict, fmt: str, where: str) -> None:
    """Raise DataError naming `where` if the row does not have the fields its format needs."""
    format_of(fmt).check(row, where)


# Tokenizing takes ~175 bytes of memory per character of text: a 50 MB line would take 9 GB only to be cut to
# data.max_seq_len tokens. So a text is tokenized only as far as truncation keeps it: cut after enough characters
# for the tokens still wanted and a margin, the first guess doubled until the cut text gives that many. A BPE or
# WordPiece model changes only the last few tokens before a cut, which the margin holds. A Unigram model
# (SentencePiece's) chooses a word's tokens over the whole word, so a cut inside a word can change its first
# tokens however far back they are: there the kept tokens must end before the word the cut falls in (a text
# without spaces, or a tokenizer that does not split words, Metaspace(split=False), is so tokenized whole).
CUT_MARGIN = 64  # tokens tokenized past those kept
CHARS_PER_TOKEN = 8  # the first guess (text holds 3 to 5 characters per token; a longer token is found by doubling)


def leading_ids(tokenizer, text: str, wanted: int) -> list[int]:
    """The token ids of `text`, or its first `wanted` (or more) where it holds more: what truncation keeps of it,
    found with memory bounded by `wanted` rather than by the text's length where the text has word boundaries."""
    chars = (wanted + CUT_MARGIN) * CHARS_PER_TOKEN
    whole_words = _chooses_over_words(tokenizer)
    while chars < len(text):
        encoding = tokenizer(text[:chars], add_special_tokens=False)
        ids = encoding["input_ids"]
        if len(ids) >= wanted + CUT_MARGIN:
            words = encoding.word_ids() if whole_words else [None]
            if words[-1] is None or words[-1] not in words[:wanted]:  # the kept tokens' words end before the cut
                return ids[:wanted]
        chars *= 2
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chooses_over_words(tokenizer) -> bool:
    """Whether the tokenizer's model picks each word's tokens over the whole word (Unigram) and tells the words
    (a fast tokenizer). A slow SentencePiece tokenizer tells no words: its cuts are taken as BPE's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.model).__name__ == "Unigram"


def _kept_counter(tokenizer, cfg: DataSection):
    """A counter per sequence for formats.rendering_until: told each segment, true once those it was told hold
    more tokens than max_seq_len (counted as tokenize_segments counts them), when the rest would be cut anyway."""

    def counter():
        count = 0

        def kept_all(text: str, is_answer: bool) -> bool:
            nonlocal count
            wanted = cfg.max_seq_len + 1 - count
            if wanted > 0:
                ids = leading_ids(tokenizer, text, wanted)
                count += len(ids) + (is_answer and tokenizer.eos_token_id not in ids)
            return count > cfg.max_seq_len

        return kept_all

    return counter


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
    if fmt.prompts:
        return tokenize_prompt(row, tokenizer, cfg, where)
    if fmt.unpaired:
        return _tokenize_unpaired(row, tokenizer, cfg, where, share_prompts, mismatched)
    if not fmt.preference:
        return tokenize_segments(_rendered(fmt.segments, row, tokenizer, cfg, where), tokenizer, cfg)
    chosen, rejected = tokenize_pair(row, tokenizer, cfg, where)
    # a pair that lost an answer, or whose answers truncation made the same, teaches nothing: left out, counted
    both = chosen["targets"] > 0 and rejected["targets"] > 0 and chosen["labels"] != rejected["labels"]
    return _two_samples(chosen, rejected, share_prompts, truncated=chosen["truncated"] or rejected["truncated"],
                        targets=chosen["targets"] + rejected["targets"] if both else 0)


def tokenize_prompt(row: dict, tokenizer, cfg: DataSection, where: str) -> dict:
    """A prompt row (GRPO) as the generation reads it: the prompt's ids (a conversation rendered with the chat
    template and its generation prompt, a text as written), its last data.max_seq_len tokens where longer (TRL cuts
    prompts on the left: the question is at the end), no targets of its own (`targets` 1: a prompt to answer), and
    the row as JSON (`row`: the prompt's text and the columns the rewards read)."""
    prompt = format_of(cfg.format).prompt_row(row, where, cfg.system_prompt)
    if isinstance(prompt.prompt, str):
        ids = tokenizer(prompt.prompt, add_special_tokens=False)["input_ids"]
    elif tokenizer.chat_template:
        try:
            ids = render_ids(tokenizer, prompt.prompt, add_generation_prompt=True)
        except (TemplateFailure, TemplateBudgetError) as err:
            raise DataError(f"{where}: {template_name(cfg)} fails on this row: {err}") from None
    elif len(prompt.prompt) == 1:  # one user turn, no template: its text
        ids = tokenizer(prompt.prompt[0]["content"], add_special_tokens=False)["input_ids"]
    else:
        raise DataError(f"{where}: a conversation needs a tokenizer with a chat template (give a plain 'prompt' "
                        "text, or use a chat model)")
    truncated = len(ids) > cfg.max_seq_len
    ids = ids[-cfg.max_seq_len:]
    try:
        record = json.dumps({"prompt": prompt.text, "columns": prompt.columns})
    except (TypeError, ValueError) as err:
        raise DataError(f"{where}: a column the rewards would read is not JSON data ({err})") from None
    return {"input_ids": ids, "labels": [IGNORE] * len(ids), "truncated": truncated, "targets": 1, "row": record}


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
        with formats.rendering_until(_kept_counter(tokenizer, cfg)):  # no prefix past what truncation keeps
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

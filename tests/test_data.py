import contextlib
import json

import pytest
import torch

from workbench import DataError
from workbench.data.batches import STAND_IN, Collator, EpochSampler, StepBatches, TrainRows
from workbench.data.prepared import pack, prepare_data
from workbench.data.tokens import IGNORE, tokenize_row
from workbench.spec.recipe import DataSection


def cfg(**kw) -> DataSection:
    return DataSection(**{"max_seq_len": 128, **kw})


CHAT = {"messages": [{"role": "user", "content": "What is 2 plus 2?"},
                     {"role": "assistant", "content": "2 plus 2 is 4."}]}


def decoded_targets(tok, out):
    return tok.decode([t for t, label in zip(out["input_ids"], out["labels"]) if label != IGNORE])


def test_chat_learns_only_the_answer_and_its_eos(tiny_tokenizer):
    out = tokenize_row(CHAT, tiny_tokenizer, cfg(), "x:1")
    assert decoded_targets(tiny_tokenizer, out) == "2 plus 2 is 4.<|im_end|>\n"
    full = tiny_tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    assert tiny_tokenizer.decode(out["input_ids"]) == full


def test_multi_turn_chat_learns_every_assistant_turn(tiny_tokenizer):
    row = {"messages": [{"role": "system", "content": "Be brief."}, *CHAT["messages"],
                        {"role": "user", "content": "And 3 plus 3?"}, {"role": "assistant", "content": "6."}]}
    out = tokenize_row(row, tiny_tokenizer, cfg(), "x:1")
    assert decoded_targets(tiny_tokenizer, out) == "2 plus 2 is 4.<|im_end|>\n6.<|im_end|>\n"


def test_train_on_all_learns_the_prompt_too(tiny_tokenizer):
    out = tokenize_row(CHAT, tiny_tokenizer, cfg(train_on="all"), "x:1")
    assert out["labels"] == out["input_ids"]


def test_system_prompt_is_added_when_missing(tiny_tokenizer):
    out = tokenize_row(CHAT, tiny_tokenizer, cfg(system_prompt="Be kind."), "x:1")
    assert tiny_tokenizer.decode(out["input_ids"]).startswith("<|im_start|>system\nBe kind.<|im_end|>")


@pytest.mark.parametrize("fmt, row, target", [
    ("alpaca", {"instruction": "Add", "input": "2 and 2", "output": "4"}, "4<|im_end|>\n"),
    ("completion", {"prompt": "The sky is", "completion": " blue"}, " blue<|im_end|>"),
    ("text", {"text": "hello world"}, "hello world<|im_end|>"),
])
def test_other_formats(tiny_tokenizer, fmt, row, target):
    out = tokenize_row(row, tiny_tokenizer, cfg(format=fmt), "x:1")
    assert decoded_targets(tiny_tokenizer, out) == target


def test_truncation_is_counted(tiny_tokenizer):
    out = tokenize_row({"text": "word " * 200}, tiny_tokenizer, cfg(format="text", max_seq_len=16), "x:1")
    assert out["truncated"] and len(out["input_ids"]) == 16


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("bad, message", [
    ('{"messages": [', r"data\.jsonl:3: invalid JSON"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"data\.jsonl:3: messages\[0\]\.role must be"),
    ({"messages": [{"role": "user", "content": 5}]}, r"data\.jsonl:3: messages\[0\]: field 'content' must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"data\.jsonl:3: no assistant message"),
    ({"text": "no messages"}, r"data\.jsonl:3: field 'messages' must be a non-empty list"),
])
def test_bad_rows_name_file_and_line(tmp_path, tiny_tokenizer, monkeypatch, bad, message):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "data.jsonl", [CHAT, "", bad, CHAT])  # line 2 is blank
    with pytest.raises(DataError, match=message):
        prepare_data(cfg(train=str(path)), tiny_tokenizer)


def test_missing_file_and_unknown_suffix(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match="no such file"):
        prepare_data(cfg(train=str(tmp_path / "none.jsonl")), tiny_tokenizer)
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        prepare_data(cfg(train=str(tmp_path / "d.txt")), tiny_tokenizer)


def test_csv_and_parquet_load(tmp_path, tiny_tokenizer, monkeypatch):
    import pandas as pd

    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    frame = pd.DataFrame({"prompt": ["a b", "c d"], "completion": [" e", " f"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        data = prepare_data(cfg(train=str(tmp_path / name), format="completion", packing=False), tiny_tokenizer)
        assert data.stats["train_samples"] == 2


def test_tokenized_data_is_cached(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "data.jsonl", [CHAT] * 5)
    first = prepare_data(cfg(train=str(path)), tiny_tokenizer)
    second = prepare_data(cfg(train=str(path)), tiny_tokenizer)
    assert (first.stats["cached"], second.stats["cached"]) == (False, True)
    assert first.train["input_ids"] == second.train["input_ids"]
    third = prepare_data(cfg(train=str(path), max_seq_len=64), tiny_tokenizer)  # other settings: not cached
    assert third.stats["cached"] is False


def test_packing_fills_sequences_and_keeps_every_sample(tiny_tokenizer):
    import datasets

    lengths = [5, 60, 33, 12, 64, 1, 40, 27]
    rows = {"input_ids": [[i] * n for i, n in enumerate(lengths)], "labels": [[i] * n for i, n in enumerate(lengths)]}
    packs = pack(datasets.Dataset.from_dict(rows), max_seq_len=64)
    assert all(len(p) <= 64 for p in packs["input_ids"])
    assert sorted(t for p in packs["input_ids"] for t in p) == sorted(t for r in rows["input_ids"] for t in r)
    assert len(packs) == 4  # 242 tokens need at least 4 bins of 64
    for ids, positions in zip(packs["input_ids"], packs["position_ids"]):
        starts = [i for i, p in enumerate(positions) if p == 0]
        segments = [ids[a:b] for a, b in zip(starts, starts[1:] + [len(ids)])]
        assert all(len(set(s)) == 1 and len(s) == lengths[s[0]] for s in segments)


def test_collator_targets_never_cross_samples():
    example = {"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, IGNORE, 5], "position_ids": [0, 1, 2, 0, 1]}
    batch = Collator(pad_token_id=0)([example, {"input_ids": [7, 8], "labels": [7, 8], "position_ids": [0, 1]}])
    assert batch["labels"].tolist() == [[2, 3, IGNORE, 5, IGNORE], [8, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]  # padding continues the sample
    assert batch["num_tokens"] == 7 and batch["num_attended"] == 9 + 3  # plain ints: no device read in the loop


def token_losses(model, batch) -> torch.Tensor:
    """Per-token losses, shaped like the batch (0 where there is no target)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    losses = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                               ignore_index=IGNORE, reduction="none")
    return losses.view(batch["labels"].shape)


@pytest.mark.parametrize("attention", ["sdpa", "per-sample", pytest.param("flex_attention", marks=pytest.mark.slow)])
def test_packed_losses_equal_samples_run_one_by_one(tiny_path, tiny_tokenizer, attention, request):
    """The proof that packing does not leak: each token's loss is the same packed or alone (with transformers'
    block-diagonal sdpa mask, the loop's per-sample attention on a CPU, and FlexAttention's document mask, the
    GPU default: on a CPU PyTorch runs its forward, compiled, though not its backward)."""
    import datasets
    from transformers import AutoModelForCausalLM

    from workbench.model.packed_attention import use_packed_attention

    implementation = "flex_attention" if attention == "flex_attention" else "sdpa"
    if implementation == "flex_attention":
        # each length compiles its own kernel: inductor's CPU code for a shape-generic FlexAttention kernel does
        # not build (torch 2.13: "cur_qSplitSize4 was not declared"); GPUs take Triton's, not this one
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=64))
        request.addfinalizer(stack.close)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32,
                                                 attn_implementation=implementation).eval()
    if attention == "per-sample":
        assert use_packed_attention(model)
    rows = [tokenize_row(r, tiny_tokenizer, cfg(train_on="all"), "x") for r in (
        CHAT, {"messages": [{"role": "user", "content": "Tell me a short story."},
                            {"role": "assistant", "content": "The robot learns the data. A student reads."}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]})]
    collate = Collator(tiny_tokenizer.pad_token_id)
    packed = pack(datasets.Dataset.from_list(rows), max_seq_len=128)
    assert len(packed) == 1
    with torch.no_grad():
        packed_losses = token_losses(model, collate([packed[0]]))[0]
        alone = []
        for r in rows:
            example = {**r, "position_ids": list(range(len(r["input_ids"])))}
            alone.append(token_losses(model, collate([example]))[0])
    # packing sorts longest first; match each sample to its segment by length
    positions = torch.tensor(packed[0]["position_ids"])
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    segments = [packed_losses[a:b] for a, b in zip(starts, starts[1:])]
    for losses in alone:
        match = [s for s in segments if len(s) == len(losses)]
        assert match and torch.allclose(match[0], losses, atol=1e-5)
    # padding must not change the losses either
    padded = collate([rows[0] | {"position_ids": list(range(len(rows[0]["input_ids"])))},
                      rows[1] | {"position_ids": list(range(len(rows[1]["input_ids"])))}])
    with torch.no_grad():
        padded_losses = token_losses(model, padded)[0][: len(alone[0])]
    assert torch.allclose(padded_losses, alone[0], atol=1e-5)


def test_sampler_order_is_seeded_per_epoch():
    sampler = EpochSampler(10, seed=1)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    sampler.set_epoch(0)
    assert list(sampler) == first and second != first and sorted(second) == list(range(10))


@pytest.mark.parametrize("size", [1, 5, 8, 9, 11, 13])
@pytest.mark.parametrize("micro, accum, world", [(1, 1, 2), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 1), (1, 1, 3),
                                                 (2, 3, 3), (1, 1, 4)])
def test_every_step_holds_the_same_samples_on_any_layout(size, micro, accum, world):
    """The processes' micro-batches, step by step, hold the next micro x accum x world samples of the epoch's order,
    the short step that ends an epoch too: every process runs as many micro-batches as the others (a stand-in where
    it has no sample left), and no sample is repeated or left out."""
    per_step = micro * accum * world
    order = list(EpochSampler(size, seed=3))
    dealt = []
    for rank in range(world):
        sampler = StepBatches(size, micro, world, rank, seed=3)
        batches = list(sampler)
        assert len(batches) == len(sampler) and all(0 < len(b) <= micro for b in batches)
        dealt.append([batches[i:i + accum] for i in range(0, len(batches), accum)])  # the loop's steps
    assert len({len(steps) for steps in dealt}) == 1 and len(dealt[0]) == -(-size // per_step)
    for step, parts in enumerate(zip(*dealt)):
        assert len({len(p) for p in parts}) == 1  # the same passes on every process
        real = sorted(i for p in parts for b in p for i in b if i >= 0)
        assert real == sorted(order[step * per_step:(step + 1) * per_step])
        stand_ins = [b for p in parts for b in p if b[0] < 0]
        assert all(len(b) == 1 for b in stand_ins) and (not stand_ins or step == len(dealt[0]) - 1)


def test_a_resumed_epoch_deals_the_rest_and_a_stand_in_counts_nothing():
    sampler = StepBatches(9, 1, 2, 1, seed=3)
    sampler.set_epoch(1)
    whole = list(sampler)
    sampler.set_epoch(1, skip=2)
    assert list(sampler) == whole[2:] and whole[-1][0] < 0
    rows = TrainRows([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "position_ids": [0, 1, 2]}])
    batch = Collator(pad_token_id=0)([rows[-1]])
    assert batch[STAND_IN] and batch["num_tokens"] == batch["num_attended"] == 0
    assert batch["input_ids"].tolist() == [[5, 6, 7]] and STAND_IN not in Collator(pad_token_id=0)([rows[0]])


def test_a_field_that_changes_type_is_named_with_both_lines(tmp_path):
    """A leading blank line and a field that turns from boolean to list: the JSON reader gives up with
    a bare parse error; the workbench names the row and the one that set the type."""
    from workbench.data.rows import load_rows

    path = tmp_path / "mixed.jsonl"
    path.write_text('\n{"id": null, "source": false, "text": "0"}\n{"source": [], "text": "0"}')
    with pytest.raises(DataError, match=rf"{path}:3: field 'source' is a list here but a boolean at {path}:2"):
        load_rows(str(path))


def test_an_empty_row_is_refused_not_dropped(tmp_path):
    """Found by fuzzing: beside a list-valued field the JSON reader drops a `{}` row without a word, so the run
    would train on fewer rows than the file holds."""
    from workbench.data.rows import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": [null, null], "text": "0"}\n{}\n')
    with pytest.raises(DataError, match=rf"{path}:2: an empty row"):
        load_rows(str(path))


def test_a_number_beyond_64_bits_is_named_with_its_line(tmp_path):
    """Found by fuzzing: pyarrow fails on an integer past int64 without saying where."""
    from workbench.data.rows import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 9223372036854775808, "source": [null, null], "prompt": "0", "completion": "0"}\n')
    with pytest.raises(DataError, match=rf"{path}:1: the number 9223372036854775808 does not fit"):
        load_rows(str(path))


def test_rows_the_json_reader_trips_on_are_still_read(tmp_path):
    """Found by fuzzing: pyarrow's JSON reader fails on a list of nulls after a blank line ("Length spanned by
    list offsets"); the rows are sound, so they are read all the same."""
    from workbench.data.rows import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('\n{"id": [null, null], "text": "0"}\n{"id": [null], "text": "1"}\n')
    rows = load_rows(str(path))
    assert [r["text"] for r in rows.dataset] == ["0", "1"] and rows.where(1) == f"{path}:3"


def test_a_list_of_mixed_types_is_named_with_its_line(tmp_path):
    from workbench.data.rows import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('\n{"id": [false, 0], "text": "0"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: a list mixes a boolean and a number"):
        load_rows(str(path))


@pytest.mark.parametrize("fmt, text, message", [
    ("completion", "prompt,completion\na b, c\nd e,\n", r"d\.csv:3: the cell in column 'completion' is empty"),
    ("completion", "prompt,completion\na b, c\n,f\n", r"d\.csv:3: the cell in column 'prompt' is empty"),
    ("alpaca", "instruction,input,output\nAdd,,4\nAdd,2 and 3,\n", r"d\.csv:3: the cell in column 'output' is empty"),
])
def test_an_empty_csv_cell_is_named_with_its_line_and_column(tmp_path, tiny_tokenizer, monkeypatch, fmt, text,
                                                             message):
    """The CSV reader gives an empty cell as null (NaN in pandas): that is an empty cell, not a missing field or a
    float. An optional column (alpaca's input) may stay empty."""
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "d.csv").write_text(text)
    with pytest.raises(DataError, match=message):
        prepare_data(cfg(train=str(tmp_path / "d.csv"), format=fmt, packing=False), tiny_tokenizer)


def test_csv_cells_keep_the_text_they_hold(tmp_path, monkeypatch):
    """A column of numbers is not read as floats ("2" stayed 2.0 and was refused as "got float"), and words that a
    table reader takes for missing values ("NA", "null") stay words."""
    from workbench.data.rows import load_rows

    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "d.csv").write_text("prompt,completion\n1 plus 1 is,2\nNA,null\n")
    rows = load_rows(str(tmp_path / "d.csv"))
    assert list(rows.dataset) == [{"prompt": "1 plus 1 is", "completion": "2"}, {"prompt": "NA", "completion": "null"}]


def test_a_nan_value_reads_as_empty_not_as_a_float():
    from workbench.spec.formats import FORMATS

    with pytest.raises(DataError, match=r"x\.csv:4: field 'completion' is empty"):
        FORMATS["completion"].check({"prompt": "a", "completion": float("nan")}, "x.csv:4")


# -- long rows -----------------------------------------------------------------------------------

LONG_TEXTS = {  # each many times what max_seq_len keeps, of the kinds that tokenize unevenly
    "prose": "The quick brown fox jumps over the lazy dog; " * 4000,
    "one word": "abcdefghij" * 20000,
    "spaces": "x" + " " * 150000 + "y",
    "equals signs": "=" * 150000,
    "mixed scripts": "naïve café 東京 Ελλάδα 🙂 " * 6000,
    "special tokens": "a<|im_end|>b<|im_start|>" * 6000,
}


@pytest.mark.parametrize("kind", sorted(LONG_TEXTS))
@pytest.mark.parametrize("fmt, row_of", [
    ("completion", lambda text: {"prompt": text, "completion": "the answer"}),
    ("completion", lambda text: {"prompt": "the question", "completion": text}),
    ("text", lambda text: {"text": text}),
    ("chat", lambda text: {"messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": text},
                                        {"role": "user", "content": text}, {"role": "assistant", "content": "b"}]}),
])
@pytest.mark.parametrize("train_on", ["completions", "all"])
def test_a_long_row_keeps_the_tokens_of_the_whole_row(tiny_tokenizer, monkeypatch, kind, fmt, row_of, train_on):
    """A text is tokenized only as far as truncation keeps it: the sample (ids, masks, truncation) is the one the
    whole row gives."""
    import workbench.data.tokens as data

    row, section = row_of(LONG_TEXTS[kind]), cfg(format=fmt, train_on=train_on, max_seq_len=300)
    cut = tokenize_row(row, tiny_tokenizer, section, "x:1")
    monkeypatch.setattr(data, "CHARS_PER_TOKEN", 1 << 40)  # no cut: every text tokenized whole
    whole = tokenize_row(row, tiny_tokenizer, section, "x:1")
    assert cut == whole and cut["truncated"] and len(cut["input_ids"]) == 300


def _many_turns(count: int) -> list[dict]:
    return [{"role": ("user", "assistant")[k % 2], "content": "ab"[k % 2]} for k in range(count)]


@pytest.mark.parametrize("fmt, row", [
    ("chat", {"messages": _many_turns(400)}),
    ("preference", {"prompt": _many_turns(399), "chosen": "yes", "rejected": "no"}),
    ("unpaired", {"prompt": _many_turns(399), "completion": "yes", "label": True}),
])
@pytest.mark.parametrize("train_on", ["completions", "all"])
def test_a_row_of_many_messages_is_rendered_only_as_far_as_truncation_keeps_it(tiny_tokenizer, monkeypatch, fmt,
                                                                               row, train_on):
    """Every prefix of a conversation is rendered: a row of thousands of messages would cost work quadratic in its
    length. Rendering stops once the segments hold what max_seq_len keeps, which gives the whole row's sample."""
    import workbench.data.tokens as data
    from workbench.spec import chat_templates

    renders = []
    real_render = chat_templates.render
    monkeypatch.setattr(chat_templates, "render", lambda *a, **k: renders.append(1) or real_render(*a, **k))
    section = cfg(format=fmt, train_on=train_on, max_seq_len=64)
    cut = tokenize_row(row, tiny_tokenizer, section, "x:1")
    assert len(renders) < 100  # a few per message kept, not per message of the row
    monkeypatch.setattr(data, "_kept_counter", lambda *_: lambda: lambda text, is_answer: False)  # render it whole
    whole = tokenize_row(row, tiny_tokenizer, section, "x:1")
    assert len(renders) > 400
    assert cut == whole and cut["truncated"]


def test_a_long_row_costs_memory_bounded_by_max_seq_len_not_by_its_length(tmp_path):
    """Tokenizing costs ~175 bytes per character: a row of some MB is cut before, not after, so that reading it
    takes a small multiple of its own size (run alone, so the peak is this row's)."""
    import subprocess
    import sys

    script = (
        "import resource, sys\n"
        "from workbench.data.tokens import tokenize_row\n"
        "from workbench.model.loading import load_tokenizer\n"
        "from workbench.spec.recipe import DataSection, ModelSection\n"
        "tokenizer = load_tokenizer(ModelSection(path='builtin:tiny'))\n"
        "section = DataSection(format='completion', max_seq_len=2048)\n"
        "tokenize_row({'prompt': 'q', 'completion': 'warm up ' * 1000}, tokenizer, section, 'x:1')\n"
        "text = 'The quick brown fox jumps over the lazy dog; ' * ((4 << 20) // 45)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "out = tokenize_row({'prompt': 'q', 'completion': text}, tokenizer, section, 'x:1')\n"
        "assert out['truncated'] and len(out['input_ids']) == 2048\n"
        "print(len(text), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    chars, grown = map(int, done.stdout.split())
    assert chars > 4_000_000
    assert grown < 8 * chars, f"reading a row of {chars:,} characters took {grown:,} more bytes of memory"


@pytest.fixture(scope="module")
def unigram_tokenizers():
    """SentencePiece-like tokenizers (a Unigram model after Metaspace), trained here on the tiny corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from workbench.base.builtin import _tiny_corpus

    corpus = _tiny_corpus() + ["x" * n for n in range(1, 50)] + [" " * n + "y" for n in range(1, 40)]
    made = {}
    for split in (True, False):
        model = Tokenizer(models.Unigram())
        model.pre_tokenizer = pre_tokenizers.Metaspace(split=split)
        model.train_from_iterator(corpus, trainer=trainers.UnigramTrainer(
            vocab_size=600, special_tokens=["<unk>", "</s>"], unk_token="<unk>", show_progress=False))
        made[split] = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="</s>", unk_token="<unk>")
    return made


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("text", ["x" * 5000, "a" + " " * 5000 + "b", "xx yy " * 2000, "".join(
    "abcxyz"[k * k % 6] for k in range(5000))])
@pytest.mark.parametrize("wanted", [1, 20, 129])
def test_a_cut_keeps_the_whole_texts_tokens_with_a_unigram_model(unigram_tokenizers, split, text, wanted):
    """A Unigram model chooses a word's tokens over the whole word: a text cut inside a long word may start with
    other tokens than the whole text, so the kept tokens are those of words that end before the cut."""
    from workbench.data.tokens import leading_ids

    tokenizer = unigram_tokenizers[split]
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert leading_ids(tokenizer, text, wanted)[:wanted] == whole[:wanted]

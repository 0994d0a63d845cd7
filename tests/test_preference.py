"""Preference data and training: the format registry, the layouts preference sets come in, pairs as rows,
DPO and ORPO runs whose margins grow, resume, the estimator and `workbench evaluate` on held-out pairs.
(Agreement with TRL's losses: tests/test_objectives.py; every distributed layout: tests/test_strategy_matrix.py.)"""

import importlib
import json
import shutil
import typing

import pytest
import torch

from workbench import DataError, Recipe, RecipeError, WorkbenchError
from workbench.data.batches import Collator, sample_starts
from workbench.data.prepared import prepare_data
from workbench.data.tokens import IGNORE, tokenize_row
from workbench.rundir.runs import RunDir
from workbench.spec.formats import FORMAT_NAMES, FORMATS, detect, format_of
from workbench.spec.recipe import DataSection
from workbench.training.objectives import counts, sample_index

PAIR = {"prompt": "What is 2 plus 3?", "chosen": "2 plus 3 is 5.", "rejected": "2 plus 3 is 6."}


def cfg(**kw):
    return DataSection(format="preference", max_seq_len=kw.pop("max_seq_len", 128), **kw)


def turns(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


# -- the registry ---------------------------------------------------------------------------------------------


def test_the_recipe_the_registry_and_detection_agree():
    assert typing.get_args(DataSection.model_fields["format"].annotation) == FORMAT_NAMES
    for fmt in FORMATS.values():
        fmt.check(fmt.example, "example")  # every declared example is a valid row of its format
        assert detect(list(fmt.example), "chat" if fmt.name != "chat" else "text") == fmt.name
    with pytest.raises(DataError, match="cannot tell the row format.*preference: chosen, rejected"):
        detect(["question", "answer"], "chat")


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_tokenizes_its_example(name, tiny_tokenizer):
    out = tokenize_row(FORMATS[name].example, tiny_tokenizer, DataSection(format=name, max_seq_len=128), "x:1")
    assert out["targets"] > 0 and len(out["input_ids"]) == len(out["labels"])
    samples = out.get("position_ids", [0]).count(0)
    assert samples == FORMATS[name].sequences_per_example


def test_an_unknown_format_is_named():
    with pytest.raises(DataError, match="data.format: unknown format 'sharegpt'"):
        format_of("sharegpt")


# -- the layouts of preference rows ------------------------------------------------------------------------------


LAYOUTS = {
    "prompt text": PAIR,
    "messages and answer texts": {"messages": [{"role": "user", "content": PAIR["prompt"]}],
                                  "chosen": PAIR["chosen"], "rejected": PAIR["rejected"]},
    "prompt messages and answer messages": {"prompt": [{"role": "user", "content": PAIR["prompt"]}],
                                            "chosen": [{"role": "assistant", "content": PAIR["chosen"]}],
                                            "rejected": [{"role": "assistant", "content": PAIR["rejected"]}]},
    "whole conversations": {"chosen": turns(PAIR["prompt"], PAIR["chosen"]),
                            "rejected": turns(PAIR["prompt"], PAIR["rejected"])},
    "whole conversations beside a prompt text": {"prompt": PAIR["prompt"],
                                                 "chosen": turns(PAIR["prompt"], PAIR["chosen"]),
                                                 "rejected": turns(PAIR["prompt"], PAIR["rejected"])},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_becomes_the_same_pair(layout, tiny_tokenizer):
    assert tokenize_row(LAYOUTS[layout], tiny_tokenizer, cfg(), "x:1") == tokenize_row(PAIR, tiny_tokenizer, cfg(),
                                                                                       "x:1")


def test_a_pair_is_one_row_of_two_samples_that_learn_only_their_answers(tiny_tokenizer):
    out = tokenize_row(PAIR, tiny_tokenizer, cfg(), "x:1")
    starts = [i for i, p in enumerate(out["position_ids"]) if p == 0]
    assert len(starts) == 2
    chosen_ids, rejected_ids = out["input_ids"][:starts[1]], out["input_ids"][starts[1]:]
    learned = [tiny_tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
               for ids, labels in ((chosen_ids, out["labels"][:starts[1]]), (rejected_ids, out["labels"][starts[1]:]))]
    assert learned == ["2 plus 3 is 5.<|im_end|>\n", "2 plus 3 is 6.<|im_end|>\n"]
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": PAIR["prompt"]}], tokenize=False,
                                                add_generation_prompt=True)
    assert tiny_tokenizer.decode(chosen_ids).startswith(prompt) and tiny_tokenizer.decode(rejected_ids).startswith(prompt)


BAD_ROWS = [
    ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": ["b"]}, "must both be strings or both lists of messages"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "are the same answer"),
    ({"prompt": "q", "chosen": "a", "rejected": " "}, "field 'rejected': empty answer"),
    ({"chosen": "a", "rejected": "b"}, "missing field 'prompt' \\(or 'messages'\\)"),
    ({"prompt": "q", "messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"},
     "give the prompt once"),
    ({"chosen": turns("q1", "a"), "rejected": turns("q2", "b")}, "differ before their last assistant message"),
    ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
     "no prompt"),
    ({"messages": turns("q", "a"), "chosen": "b", "rejected": "c"}, "prompt ends with an assistant message"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "field 'chosen' must be a string or a list of messages, got int"),
    ({"prompt": "q", "chosen": "a", "rejected": "a "}, "are the same answer"),
    ({"prompt": " ", "chosen": "a", "rejected": "b"}, "the prompt's user turn is empty"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}], "chosen": "a",
      "rejected": "b"}, "the prompt ends with a system message"),
    ({"chosen": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]},
     "the prompt ends with a system message"),
    ({"prompt": "another question", "chosen": turns("q", "a"), "rejected": turns("q", "b")},
     "field 'prompt' differs from the user turn"),
    ({"messages": [{"role": "user", "content": "q"}], "chosen": turns("q", "a"), "rejected": turns("q", "b")},
     "give the prompt once"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS, ids=[m for _, m in BAD_ROWS])
def test_a_bad_preference_row_is_named_with_its_line(row, message, tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"{path}:2: .*{message}"):
        prepare_data(cfg(train=str(path)), tiny_tokenizer)


def test_a_file_that_mixes_layouts_names_the_row_and_keeps_every_value(tmp_path, tiny_tokenizer, monkeypatch):
    """The data set reader re-reads a column of mixed JSON types value by value ("1." came back as 1.0, blamed
    on a good row): such a column is named with both rows instead."""
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "What is 0 plus 1?", "chosen": "1.", "rejected": "2."}
    path.write_text(json.dumps(good) + "\n" + json.dumps(LAYOUTS["whole conversations"]) + "\n")
    with pytest.raises(DataError, match=f"{path}:2: field 'chosen' is a list here but a string at {path}:1"):
        prepare_data(cfg(train=str(path)), tiny_tokenizer)


@pytest.mark.parametrize("layout", ["whole conversations", "prompt messages and answer messages",
                                    "messages and answer texts"])
def test_a_non_text_content_is_named_at_its_own_line(layout, tmp_path, tiny_tokenizer, monkeypatch):
    """`"content": 1` on line 5 makes the reader re-read the whole column value by value (the answer "5." of
    line 1 came back as 5.0): the row at fault is named, as the chat format names it."""
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))

    def row(question):
        user = [{"role": "user", "content": question}]
        answer = {"chosen": "5.", "rejected": "6."}
        return {"whole conversations": {k: [*user, {"role": "assistant", "content": v}] for k, v in answer.items()},
                "prompt messages and answer messages": {"prompt": user, **{k: [{"role": "assistant", "content": v}]
                                                                           for k, v in answer.items()}},
                "messages and answer texts": {"messages": user, **answer}}[layout]

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row(q)) + "\n" for q in ["What is 2 plus 3?"] * 4 + [1] + ["q"] * 3))
    with pytest.raises(DataError, match=rf"{path}:5: .*field 'content' must be a string, got int"):
        prepare_data(cfg(train=str(path)), tiny_tokenizer)


def test_only_the_final_answer_of_a_multi_turn_prompt_is_compared(tiny_tokenizer):
    row = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": PAIR["prompt"]}], "chosen": PAIR["chosen"], "rejected": PAIR["rejected"]}
    out = tokenize_row(row, tiny_tokenizer, cfg(), "x:1")
    learned = tiny_tokenizer.decode([t for t, label in zip(out["input_ids"], out["labels"]) if label != IGNORE])
    assert learned == "2 plus 3 is 5.<|im_end|>\n2 plus 3 is 6.<|im_end|>\n"  # not the earlier "Hello."


def test_packing_keeps_pairs_whole_and_in_order(tmp_path, tiny_tokenizer, monkeypatch):
    """Sample 2k is a chosen answer and 2k + 1 its rejected one, in every packed row."""
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    data = prepare_data(cfg(train="recipes/data/preference_train.jsonl", max_seq_len=64), tiny_tokenizer)
    unpacked = prepare_data(cfg(train="recipes/data/preference_train.jsonl", max_seq_len=64, packing=False),
                            tiny_tokenizer)
    assert len(data.train) < len(unpacked.train) == 176
    assert all(len(ids) <= 128 for ids in data.train["input_ids"])  # two sequences of max_seq_len per row
    pairs = sorted(tuple(row) for row in unpacked.train["input_ids"])
    found = []
    for ids, positions in zip(data.train["input_ids"], data.train["position_ids"]):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        samples = [ids[a:b] for a, b in zip(starts, starts[1:])]
        assert len(samples) % 2 == 0
        found += [tuple(samples[k] + samples[k + 1]) for k in range(0, len(samples), 2)]
    assert sorted(found) == pairs  # every pair exactly once, chosen before rejected
    batch = Collator(tiny_tokenizer.pad_token_id)([data.train[i] for i in range(3)])
    index = sample_index(batch["position_ids"])
    assert int(index.max()) + 1 == batch["num_samples"] and batch["num_samples"] % 2 == 0
    c = counts(batch)
    assert int(c[1]) == batch["num_samples"] // 2 and 0 < int(c[2]) < int(c[0])


def test_a_pair_can_hold_its_prompt_once(tiny_tokenizer):
    """[prompt but its last token][last prompt token + chosen][last prompt token + rejected]: the same targets as
    two whole samples, the rejected answer's positions continuing the prompt; nothing to share when the prompt
    carries targets (train_on: all)."""
    whole = tokenize_row(PAIR, tiny_tokenizer, cfg(), "x:1")
    shared = tokenize_row(PAIR, tiny_tokenizer, cfg(), "x:1", share_prompts=True)
    chosen_len = whole["position_ids"].index(0, 1)
    prompt_len = next(i for i, label in enumerate(whole["labels"]) if label != IGNORE)
    assert shared["input_ids"] == whole["input_ids"][:chosen_len] + whole["input_ids"][chosen_len + prompt_len - 1:]
    assert shared["position_ids"] == list(range(chosen_len)) + list(range(prompt_len - 1, len(whole["input_ids"])
                                                                              - chosen_len))
    assert shared["targets"] == whole["targets"] > 0
    assert int(sample_starts(torch.tensor(shared["position_ids"])).sum()) == 2
    assert shared["whole_length"] == len(whole["input_ids"])  # what packing bins by

    def targets_by_sample(example):
        batch = Collator(tiny_tokenizer.pad_token_id)([example])
        index, labels = sample_index(batch["position_ids"]), batch["labels"].flatten()
        return [labels[(index == k) & (labels != IGNORE)].tolist() for k in range(batch["num_samples"])]

    assert targets_by_sample(shared) == targets_by_sample(whole)  # each answer predicted from the same tokens
    everything = cfg(train_on="all")
    unshared = tokenize_row(PAIR, tiny_tokenizer, everything, "x:1", share_prompts=True)
    assert unshared.pop("whole_length") == len(whole["input_ids"])
    assert unshared == tokenize_row(PAIR, tiny_tokenizer, everything, "x:1")


def test_a_pair_that_loses_an_answer_to_truncation_is_left_out(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    long = {**PAIR, "prompt": "word " * 200}
    same_once_cut = {**PAIR, "chosen": "x " * 100 + "A", "rejected": "x " * 100 + "B"}  # they differ past the cut
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (PAIR, long, same_once_cut)) + "\n")
    data = prepare_data(cfg(train=str(path), max_seq_len=64), tiny_tokenizer)
    assert data.stats["train_empty"] == 2 and data.stats["train_truncated"] == 2 and len(data.train) == 1


# -- the recipe ---------------------------------------------------------------------------------------------------


REFUSED = [
    (["data.format=preference"], r"training.objective: sft does not learn from data.format preference rows "
                                 r"\(preference trains objective dpo or orpo or reward\)"),
    (["training.objective=dpo"], "data.format: training.objective dpo learns from preference rows; set data.format: "
                                 r"preference \(got chat\)"),
    (["data.format=preference", "training.objective=dpo", "adapter.method=full"],
     "training.objective: dpo compares against the base model with the adapter switched off"),
    (["data.format=preference", "training.objective=orpo", "data.train_on=all"],
     "data.train_on: preference rows are scored on their answers"),
    (["data.format=preference", "training.objective=dpo", "training.dpo_beta=0"], "training.dpo_beta"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_contradictory_recipes_are_refused_naming_the_field(overrides, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.load("recipes/tiny.yaml", overrides)


def test_orpo_trains_full_fine_tuning_without_a_reference():
    Recipe.load("recipes/tiny-dpo.yaml", ["training.objective=orpo", "adapter.method=full"])


def test_the_estimate_counts_two_sequences_per_pair_and_the_reference_forward():
    from workbench.estimator.memory import estimate

    sft = Recipe.load("recipes/tiny.yaml", ["training.micro_batch_size=8", "data.max_seq_len=256"])
    dpo = sft.override("data.format=preference", "training.objective=dpo")
    row = {name: estimate(r, device="cpu") for name, r in (("sft", sft), ("dpo", dpo))}
    single = {name: next(s for s in e.strategies if s["name"] == "single") for name, e in row.items()}
    assert single["dpo"]["breakdown"]["activations"] > 1.8 * single["sft"]["breakdown"]["activations"]
    assert row["dpo"].throughput["flops_per_token"] > row["sft"].throughput["flops_per_token"]


# -- training -----------------------------------------------------------------------------------------------------


def preference_run(tmp_path, objective: str, *extra):
    from workbench import train

    recipe = Recipe.load("recipes/tiny-dpo.yaml", [
        f"output.dir={tmp_path}/{{name}}", f"training.objective={objective}", "training.threads=1",
        "model.dtype=float32", "training.mixed_precision=no", *extra])
    return train(recipe, progress_bar=False)


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# (objective, least growth of the held-out reward margin, least final accuracy): ORPO's reward is lambda times
# a mean token log-probability, a far smaller scale than DPO's summed log-ratio
GROWTH = {"dpo": (0.5, 0.7), "orpo": (0.005, 0.6)}


@pytest.mark.slow
@pytest.mark.parametrize("objective", list(GROWTH))
def test_the_margin_grows_on_the_shipped_recipe(objective, tmp_path):
    result = preference_run(tmp_path, objective)
    evals = [r for r in rows_of(result.run_dir) if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    growth, accuracy = GROWTH[objective]
    assert result.summary["objective"] == objective
    assert last["eval_reward_margin"] > first["eval_reward_margin"] + growth, (first, last)
    assert last["eval_reward_accuracy"] >= accuracy and last["eval_loss"] < first["eval_loss"], (first, last)
    if objective == "dpo":  # the tuned model starts as its own reference
        assert first["eval_loss"] == pytest.approx(0.693147, abs=1e-5) and first["eval_reward_margin"] == 0
    train_rows = [r for r in rows_of(result.run_dir) if "loss" in r]
    assert {"rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
            "logps_rejected"} <= set(train_rows[-1])
    assert result.summary["eval_reward_margin_final"] == last["eval_reward_margin"]


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_sharing_the_prompt_trains_as_whole_sequences_do(objective, tmp_path, monkeypatch):
    """The loop's default on a CPU (each pair holds its prompt once) against the pairs as two whole sequences:
    the same losses, rewards and held-out figures, step by step."""
    resume = importlib.import_module("workbench.training.resume")  # where the run decides the pair layout
    steps = ["data.packing=false", "training.max_steps=4", "output.log_every=1", "output.eval_every=4",
             "output.save_every=null"]
    shared = preference_run(tmp_path / "shared", objective, *steps)
    monkeypatch.setattr(resume, "shares_prompts", lambda *_: False)
    whole = preference_run(tmp_path / "whole", objective, *steps)
    assert shared.summary["shared_prompts"] is True and whole.summary["shared_prompts"] is False
    assert shared.summary["tokens"] < 0.9 * whole.summary["tokens"]
    keys = ("loss", "reward_margin", "logps_chosen", "logps_rejected", "eval_loss", "eval_reward_margin")
    figures = [{k: r[k] for k in keys if r.get(k) is not None} for r in rows_of(shared.run_dir)]
    expected = [{k: r[k] for k in keys if r.get(k) is not None} for r in rows_of(whole.run_dir)]
    assert len(figures) == len(expected) == 6 and sum(len(f) for f in figures) >= 20
    for got, want in zip(figures, expected):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_a_resumed_run_keeps_the_pair_layout_it_started_with(tmp_path):
    """Rows (and so what a checkpoint counted) depend on the layout: a run started with whole pairs resumes with
    whole pairs; one started with shared prompts cannot resume where attention cannot read them."""
    from transformers import LlamaConfig

    from workbench.model.attention import Attention
    from workbench.training.resume import ResumePlan

    recipe = Recipe.load("recipes/tiny-dpo.yaml")
    cpu, gpu = Attention("sdpa", "per_sample", "cpu"), Attention("flex_attention", "document_mask", "gpu")
    run = RunDir(tmp_path / "run")

    def shares(attention, resume, r=recipe):
        _, plan = ResumePlan.start(r, run, resume, world_size=1)
        return plan.share_prompts(r, attention, LlamaConfig())

    assert shares(cpu, resume=False) and not shares(gpu, resume=False)
    assert shares(cpu, resume=True)  # nothing recorded yet: as a new run
    run.path.mkdir()
    run.update_json(summary={"train_sha256": "0" * 64})  # started before pairs could share a prompt
    assert not shares(cpu, resume=True)
    run.update_json(summary={"shared_prompts": True})
    assert shares(cpu, resume=True)
    with pytest.raises(WorkbenchError, match="holding its prompt once.*attention flex_attention"):
        shares(gpu, resume=True)
    with pytest.raises(WorkbenchError, match="adapter.dropout 0.1"):
        shares(cpu, resume=True, r=recipe.override("adapter.dropout=0.1"))


def test_pairs_share_prompts_only_without_dropout():
    """Dropout over a shared prompt is drawn once for both answers, over two whole sequences twice: not the same
    loss, so a run with LoRA dropout or a model that drops out keeps whole pairs."""
    from transformers import GPT2Config, LlamaConfig

    from workbench.model.attention import Attention, model_drops_out, shares_prompts

    recipe, cpu = Recipe.load("recipes/tiny-dpo.yaml"), Attention("sdpa", "per_sample", "cpu")
    assert shares_prompts(cpu, recipe, LlamaConfig())
    assert not shares_prompts(cpu, recipe.override("adapter.dropout=0.05"), LlamaConfig())
    assert not shares_prompts(cpu, recipe, LlamaConfig(attention_dropout=0.1))
    assert model_drops_out(GPT2Config()) and not model_drops_out(GPT2Config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    assert not shares_prompts(cpu, recipe.override("data.format=alpaca", "training.objective=sft"), LlamaConfig())


def test_shared_prompts_pack_into_the_rows_whole_pairs_do(tmp_path, tiny_tokenizer, monkeypatch):
    """Packing bins a pair by its two whole sequences: the same rows, pairs and so steps as whole pairs (on a GPU,
    or in the data preview), each row shorter by its prompts."""
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    section = cfg(train="recipes/data/preference_train.jsonl", max_seq_len=64)
    whole, shared = (prepare_data(section, tiny_tokenizer, share_prompts=share) for share in (False, True))
    assert len(shared.train) == len(whole.train) and whole.stats["shared_prompts"] is False
    assert shared.stats["shared_prompts"] is True and "whole_length" not in shared.train.column_names

    def answers(row):  # each row's answers, in order: what training learns from it
        return [tuple(t for t in row["labels"] if t != IGNORE)]

    assert [answers(r) for r in shared.train] == [answers(r) for r in whole.train]
    assert sum(map(len, shared.train["input_ids"])) < 0.85 * sum(map(len, whole.train["input_ids"]))


@pytest.mark.slow
def test_a_resumed_dpo_run_equals_an_uninterrupted_one(tmp_path):
    steps = ["training.max_steps=6", "output.save_every=3", "output.log_every=1", "output.eval_every=null"]
    whole = preference_run(tmp_path / "whole", "dpo", *steps)
    cut = tmp_path / "cut" / "tiny-dpo"
    shutil.copytree(whole.run_dir, cut)
    run = RunDir(cut)
    shutil.rmtree(run.checkpoint(6))
    shutil.rmtree(cut / "adapter")
    run.update_json(summary={"status": "running"})
    from workbench import train

    recipe = Recipe.load("recipes/tiny-dpo.yaml", [f"output.dir={tmp_path}/cut/{{name}}", "training.objective=dpo",
                                                   "training.threads=1", "model.dtype=float32",
                                                   "training.mixed_precision=no", *steps])
    resumed = train(recipe, resume=True, progress_bar=False)
    keys = ("loss", "reward_margin", "reward_accuracy")
    assert [r[k] for r in rows_of(resumed.run_dir) if "loss" in r for k in keys] == pytest.approx(
        [r[k] for r in rows_of(whole.run_dir) if "loss" in r for k in keys], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_evaluate_reports_preference_accuracy_base_beside_tuned(tmp_path):
    from workbench.outputs.evaluation import evaluate, format_evaluation

    result = preference_run(tmp_path, "dpo")
    report = evaluate(result.run_dir)
    assert report["rows"] == 24 and report["format"] == "preference"
    tuned, base = report["tuned"], report["base"]
    assert tuned["logp_margin"] > base["logp_margin"]  # tuning moved probability towards the chosen answers
    # the implicit reward against the base is what training's evaluation measured on the same pairs
    assert tuned["reward_margin"] == pytest.approx(result.summary["eval_reward_margin_final"], rel=1e-3)
    assert tuned["reward_accuracy"] == pytest.approx(result.summary["eval_reward_accuracy_final"], abs=1e-4)
    assert RunDir(result.run_dir).read_json()["evaluation"]["tuned"] == tuned
    text = format_evaluation(report)
    assert "preference_accuracy" in text and "reward_margin" in text


def test_sample_index_follows_restarting_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    assert sample_index(positions).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]

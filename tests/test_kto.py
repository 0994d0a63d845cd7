"""KTO: unpaired rows (one answer and its label), the mismatched KL samples built from them, the recipe's
rules, runs whose reward margin grows, resume, the data preview and `workbench evaluate` on held-out rows.
(Agreement with TRL's KTOTrainer: tests/test_objectives.py; every distributed layout: tests/test_strategy_matrix.py.)"""

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from workbench import DataError, Recipe, RecipeError
from workbench.data.batches import Collator
from workbench.data.prepared import prepare_data
from workbench.data.tokens import IGNORE, tokenize_row
from workbench.rundir.runs import RunDir
from workbench.spec.formats import detect, format_of
from workbench.spec.objectives import objectives_reading
from workbench.spec.recipe import DataSection
from workbench.training.objectives import only_samples, sample_index

ROW = {"prompt": "What is 2 plus 3?", "completion": "2 plus 3 is 5.", "label": True}


def cfg(**kw):
    return DataSection(format="unpaired", max_seq_len=kw.pop("max_seq_len", 128), **kw)


def answer_tokens(sample: dict) -> list[int]:
    return [t for t in sample["labels"] if t != IGNORE]


# -- rows -------------------------------------------------------------------------------------------------------


def test_unpaired_rows_are_detected_and_not_taken_for_completions():
    assert detect(["prompt", "completion", "label"], "chat") == "unpaired"
    assert detect(["prompt", "completion"], "chat") == "completion"
    assert detect(["messages", "completion", "label"], "alpaca") == "unpaired"
    assert objectives_reading(format_of("unpaired").rows) == ("kto",) and format_of("unpaired").sequences_per_example == 2


LAYOUTS = {
    "prompt text": ROW,
    "prompt and completion as messages": {"prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
                                          "completion": [{"role": "assistant", "content": "2 plus 3 is 5."}],
                                          "label": True},
    "messages for the prompt": {"messages": [{"role": "user", "content": "What is 2 plus 3?"}],
                                "completion": "2 plus 3 is 5.", "label": True},
}


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "prompt text"])
def test_every_conversational_layout_becomes_the_same_example(layout, tiny_tokenizer):
    expected = tokenize_row(LAYOUTS["prompt and completion as messages"], tiny_tokenizer, cfg(), "x:1")
    assert tokenize_row(LAYOUTS[layout], tiny_tokenizer, cfg(), "x:1") == expected


def test_a_plain_text_row_is_its_text_and_a_conversation_is_rendered(tiny_tokenizer):
    """As TRL's KTOTrainer has it (tests/test_objectives.py compares the ids): text rows are the prompt and the
    answer as written, then the EOS; rows of messages, or a row given data.system_prompt, go through the chat
    template."""
    def sample(row, **kw):
        example = tokenize_row(row, tiny_tokenizer, cfg(**kw), "x:1")
        return example["input_ids"][:example["position_ids"].index(0, 1)]

    eos = [tiny_tokenizer.eos_token_id]
    raw = tiny_tokenizer(ROW["prompt"], add_special_tokens=False)["input_ids"] + \
        tiny_tokenizer(ROW["completion"], add_special_tokens=False)["input_ids"] + eos
    assert sample(ROW) == raw
    assert tiny_tokenizer.decode(sample(LAYOUTS["messages for the prompt"])) == tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": ROW["prompt"]}, {"role": "assistant", "content": ROW["completion"]}],
        tokenize=False)
    assert "Be brief." in tiny_tokenizer.decode(sample(ROW, system_prompt="Be brief."))


def test_a_row_is_its_answer_then_another_rows_answer_never_learned(tiny_tokenizer):
    """Sample 0 learns the row's own answer; sample 1 answers the same prompt with the mismatched completion, its
    tokens scored for the KL estimate and left out of every loss."""
    example = tokenize_row({**ROW, "label": False}, tiny_tokenizer, cfg(), "x:1", mismatched="I am Quill.")
    split = example["position_ids"].index(0, 1)
    first = {k: example[k][:split] for k in ("input_ids", "labels")}
    second = {k: example[k][split:] for k in ("input_ids", "labels")}
    assert tiny_tokenizer.decode(answer_tokens(first)).startswith("2 plus 3 is 5.")
    assert tiny_tokenizer.decode(answer_tokens(second)).startswith("I am Quill.")
    assert example["targets"] == len(answer_tokens(first)) and example["desirable"] == [False]
    prompt = first["input_ids"][:first["labels"].index(next(t for t in first["labels"] if t != IGNORE))]
    assert second["input_ids"][:len(prompt)] == prompt  # the same prompt before either answer


BAD_ROWS = [
    ({"prompt": "q", "completion": "a"}, "missing field 'label' \\(true where the completion is desirable"),
    ({"prompt": "q", "completion": "a", "label": "yes"}, "field 'label' must be true or false, got 'yes'"),
    ({"prompt": "q", "completion": "a", "label": 1}, "field 'label' must be true or false, got 1"),
    ({"prompt": "q", "completion": 3, "label": True}, "completion"),
    ({"prompt": "q", "completion": " ", "label": True}, "empty"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS, ids=[m[:30] for _, m in BAD_ROWS])
def test_a_bad_row_is_named_with_its_line(row, message, tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"{path}:2: .*{message}"):
        prepare_data(cfg(train=str(path)), tiny_tokenizer)


def test_labels_in_a_csv_file_are_read_from_their_text(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "rows.csv"
    path.write_text("prompt,completion,label\nWhat is 2 plus 3?,2 plus 3 is 5.,true\nWhat is 2 plus 2?,2 plus 2 is 5.,"
                    "FALSE\nWhat is 1 plus 1?,1 plus 1 is 2.,True\n")
    data = prepare_data(cfg(train=str(path), packing=False), tiny_tokenizer)
    assert [e["desirable"] for e in data.train] == [[True], [False], [True]]


def test_a_source_of_one_row_is_refused(tmp_path, tiny_tokenizer, monkeypatch):
    """Its KL sample would be its own answer: the reference point would be the row's own reward."""
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    with pytest.raises(DataError, match=f"{path}: 1 unpaired row; .*at least 2 rows"):
        prepare_data(cfg(train=str(path)), tiny_tokenizer)


def test_a_bad_first_row_is_named_before_the_last_row_it_borrows_from(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "rows.jsonl"
    bad = {"prompt": "q", "completion": "a", "label": "yes"}
    path.write_text("\n".join(json.dumps(r) for r in (bad, ROW, bad)) + "\n")
    with pytest.raises(DataError, match=f"{path}:1: field 'label'"):
        prepare_data(cfg(train=str(path)), tiny_tokenizer)


def test_a_row_without_its_label_stops_the_cli_before_anything_trains(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (ROW, ROW, {"prompt": "q", "completion": "a"})) + "\n")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "workbench", "train", "recipes/tiny-kto.yaml", f"data.train={path}",
                           f"output.dir={out}", "--no-progress"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LORA_WORKBENCH_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {path}:3: missing field 'label' (true where the completion is desirable, false "
                      "where not)"], done.stderr
    assert not (out / "adapter").exists() and not list(out.glob("checkpoint-*"))


def test_each_rows_kl_sample_is_the_previous_rows_answer(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"Question {k}?", "completion": f"Answer number {k}.", "label": k % 2 == 0} for k in range(5)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    data = prepare_data(cfg(train=str(path), packing=False), tiny_tokenizer)
    for k, example in enumerate(data.train):
        split = example["position_ids"].index(0, 1)
        kl_sample = tiny_tokenizer.decode(example["input_ids"][split:])
        assert f"Question {k}?" in kl_sample and f"Answer number {(k - 1) % 5}." in kl_sample
        # its answer keeps its targets: the KL estimate scores them (objectives.KTO never learns from them)
        assert tiny_tokenizer.decode(answer_tokens({"labels": example["labels"][split:]})).startswith(
            f"Answer number {(k - 1) % 5}.")
        assert example["desirable"] == [k % 2 == 0]


def test_packing_keeps_each_label_with_its_row(tmp_path, tiny_tokenizer, monkeypatch):
    """Each packed row holds whole examples, answer before KL sample, with their labels in the same order; the
    collated batch carries one label per example and the KTO views select answers and KL samples alone."""
    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    source = "recipes/data/unpaired_train.jsonl"
    packed = prepare_data(cfg(train=source), tiny_tokenizer)
    whole = prepare_data(cfg(train=source, packing=False), tiny_tokenizer)
    assert len(packed.train) < len(whole.train) == 176
    labelled = sorted((tuple(e["input_ids"]), e["desirable"][0]) for e in whole.train)
    found = []
    for example in packed.train:
        positions, ids = example["position_ids"], example["input_ids"]
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        samples = [ids[a:b] for a, b in zip(starts, starts[1:])]
        assert len(samples) == 2 * len(example["desirable"])
        found += [(tuple(samples[k] + samples[k + 1]), example["desirable"][k // 2]) for k in range(0, len(samples), 2)]
    assert sorted(found) == labelled
    batch = Collator(tiny_tokenizer.pad_token_id)([packed.train[i] for i in range(3)])
    assert batch["desirable"].tolist() == [d for i in range(3) for d in packed.train[i]["desirable"]]
    assert batch["num_samples"] == 2 * len(batch["desirable"])
    odd = sample_index(batch["position_ids"]).view_as(batch["labels"]) % 2 == 1
    answers, kl = only_samples(batch, 0)["labels"], only_samples(batch, 1)["labels"]
    assert (answers[odd] == IGNORE).all() and (kl[~odd] == IGNORE).all()
    assert (kl != IGNORE).sum() > 0 and bool((answers.where(~odd, kl) == batch["labels"]).all())


# -- the recipe -------------------------------------------------------------------------------------------------


REFUSED = [
    (["data.format=unpaired"], r"training.objective: sft does not learn from data.format unpaired rows "
                               r"\(unpaired trains objective kto\); give"),
    (["training.objective=kto"], "data.format: training.objective kto learns from unpaired rows; set data.format: "
                                 r"unpaired \(got chat\)"),
    (["data.format=preference", "training.objective=kto"], "give unpaired rows"),
    (["data.format=unpaired", "training.objective=dpo"], "give preference rows"),
    (["data.format=unpaired", "training.objective=kto", "adapter.method=full"],
     "training.objective: kto compares against the base model with the adapter switched off.*lora/qlora/dora$"),
    (["data.format=unpaired", "training.objective=kto", "data.train_on=all"],
     "data.train_on: unpaired rows are scored on their answers"),
    (["data.format=unpaired", "training.objective=kto", "training.kto_beta=0"], "training.kto_beta"),
    (["data.format=unpaired", "training.objective=kto", "training.kto_desirable_weight=-1"],
     "training.kto_desirable_weight"),
    (["data.format=unpaired", "training.objective=kto", "adapter.init=pissa"], "adapter.init"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_contradictory_recipes_are_refused_naming_the_field(overrides, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.load("recipes/tiny.yaml", overrides)


def test_unpaired_rows_do_not_mix_with_single_answers():
    with pytest.raises(RecipeError, match=r"data.train\[1\].format: chat rows cannot mix with data.format unpaired"):
        Recipe.load("recipes/tiny-kto.yaml", ["data.train=[recipes/data/unpaired_train.jsonl, "
                                              "{path: recipes/data/tiny_chat.jsonl, format: chat}]"])


def test_the_estimate_counts_two_sequences_and_two_reference_forwards():
    from workbench.estimator.memory import estimate

    sft = Recipe.load("recipes/tiny.yaml", ["training.micro_batch_size=8", "data.max_seq_len=256"])
    kto = sft.override("data.format=unpaired", "training.objective=kto")
    dpo = sft.override("data.format=preference", "training.objective=dpo")
    rows = {name: estimate(r, device="cpu") for name, r in (("sft", sft), ("kto", kto), ("dpo", dpo))}
    single = {name: next(s for s in e.strategies if s["name"] == "single") for name, e in rows.items()}
    assert single["kto"]["breakdown"]["activations"] > 1.8 * single["sft"]["breakdown"]["activations"]
    flops = {name: e.throughput["flops_per_token"] for name, e in rows.items()}
    assert flops["kto"] > flops["dpo"] > flops["sft"]  # KTO scores the KL samples with the adapter on as well


# -- training ---------------------------------------------------------------------------------------------------


def kto_run(tmp_path, *extra):
    from workbench import train

    recipe = Recipe.load("recipes/tiny-kto.yaml", [
        f"output.dir={tmp_path}/{{name}}", "training.threads=1", "model.dtype=float32",
        "training.mixed_precision=no", *extra])
    return train(recipe, progress_bar=False)


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_reward_margin_grows_and_evaluate_reports_it(tmp_path):
    from workbench.outputs.evaluation import evaluate, format_evaluation
    from workbench.outputs.preview import preview_data

    result = kto_run(tmp_path)
    evals = [r for r in rows_of(result.run_dir) if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    assert result.summary["objective"] == "kto"
    # the tuned model starts as its own reference: every reward 0, the loss 1 - sigmoid(0) = 0.5
    assert first["eval_loss"] == pytest.approx(0.5, abs=1e-5) and first["eval_reward_margin"] == 0
    assert last["eval_loss"] < first["eval_loss"] - 0.03 and last["eval_reward_margin"] > 0.5, (first, last)
    # held out, the tiny model lowers the undesirable answers (near misses) far more than it raises the right
    # ones above the reference point: more rows on their label's side, though not many more
    assert last["eval_reward_accuracy"] > first["eval_reward_accuracy"], (first, last)
    assert last["eval_rewards_chosen"] > last["eval_rewards_rejected"] + 0.5, last
    train_rows = [r for r in rows_of(result.run_dir) if "loss" in r]
    assert {"kl", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"} <= set(train_rows[-1])
    assert all(r["kl"] >= 0 for r in train_rows)

    report = evaluate(result.run_dir)
    assert report["rows"] == 24 and report["format"] == "unpaired" and report["beta_source"] == "training.kto_beta"
    tuned, base = report["tuned"], report["base"]
    assert tuned["logp_margin"] > base["logp_margin"]  # probability moved towards the desirable answers
    assert tuned["reward_margin"] == pytest.approx(last["eval_reward_margin"], rel=1e-3)
    assert tuned["kl"] >= 0 and 0 <= tuned["reward_accuracy"] <= 1
    assert "logps_desirable" in format_evaluation(report)
    card = (result.run_dir / "adapter" / "README.md").read_text()
    assert "KTO" in card and "beta = 0.1" in card

    shown = preview_data("recipes/tiny-kto.yaml", rows=4)
    assert [s.label for _, samples in shown.rows for s in samples] == ["undesirable", "undesirable", "desirable",
                                                                         "desirable"]
    assert shown.stats["sequences"] == 2 * shown.stats["rows"]


def test_sharing_the_prompt_trains_as_whole_sequences_do(tmp_path, monkeypatch):
    """On a CPU a row holds its prompt once, the KL sample continuing it: the same losses, KL estimates and
    rewards as the answer and the KL sample as two whole sequences, step by step."""
    resume = importlib.import_module("workbench.training.resume")  # where the run decides the layout
    steps = ["data.packing=false", "training.max_steps=4", "output.log_every=1", "output.eval_every=4",
             "output.save_every=null"]
    shared = kto_run(tmp_path / "shared", *steps)
    monkeypatch.setattr(resume, "shares_prompts", lambda *_: False)
    whole = kto_run(tmp_path / "whole", *steps)
    assert shared.summary["shared_prompts"] is True and whole.summary["shared_prompts"] is False
    assert shared.summary["tokens"] < 0.9 * whole.summary["tokens"]
    keys = ("loss", "kl", "reward_margin", "logps_chosen", "logps_rejected", "eval_loss", "eval_kl")
    figures = [{k: r[k] for k in keys if r.get(k) is not None} for r in rows_of(shared.run_dir)]
    expected = [{k: r[k] for k in keys if r.get(k) is not None} for r in rows_of(whole.run_dir)]
    assert len(figures) == len(expected) == 6 and sum(len(f) for f in figures) >= 20
    for got, want in zip(figures, expected):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_a_resumed_kto_run_equals_an_uninterrupted_one(tmp_path):
    steps = ["training.max_steps=6", "output.save_every=3", "output.log_every=1", "output.eval_every=null"]
    whole = kto_run(tmp_path / "whole", *steps)
    cut = tmp_path / "cut" / "tiny-kto"
    shutil.copytree(whole.run_dir, cut)
    run = RunDir(cut)
    shutil.rmtree(run.checkpoint(6))
    shutil.rmtree(cut / "adapter")
    run.update_json(summary={"status": "running"})
    from workbench import train

    recipe = Recipe.load("recipes/tiny-kto.yaml", [f"output.dir={tmp_path}/cut/{{name}}", "training.threads=1",
                                                   "model.dtype=float32", "training.mixed_precision=no", *steps])
    resumed = train(recipe, resume=True, progress_bar=False)
    keys = ("loss", "kl", "reward_margin", "reward_accuracy")
    assert [r[k] for r in rows_of(resumed.run_dir) if "loss" in r for k in keys] == pytest.approx(
        [r[k] for r in rows_of(whole.run_dir) if "loss" in r for k in keys], rel=1e-5, abs=1e-7)

"""Reward models (training.objective: reward): the recipe's rules, a run whose held-out accuracy grows, the adapter
saved as a standard sequence-classification adapter that transformers + peft load and that scores as training
did, the merged classifier, evaluate, resume, and the commands that cannot apply refused in one line.
(Agreement with TRL's RewardTrainer: tests/test_objectives.py; every distributed layout: tests/test_strategy_matrix.py.)"""

import json
import shutil

import pytest
import torch

from workbench import Recipe, RecipeError, WorkbenchError, preview_data
from workbench.rundir.runs import RunDir

PAIR = {"prompt": "What is 2 plus 3?", "chosen": "2 plus 3 is 5.", "rejected": "2 plus 3 is 6."}


REFUSED = [
    (["training.objective=reward"], "data.format: training.objective reward learns from preference rows; set "
                                    r"data.format: preference \(got chat\)"),
    (["training.objective=reward", "data.format=unpaired"], "give preference rows"),
    (["training.objective=reward", "data.format=preference", "adapter.method=full"],
     "training.objective: reward trains an adapter and the score head beside it"),
    (["training.objective=reward", "data.format=preference", "data.train_on=all"],
     "data.train_on: preference rows are scored on their answers"),
    (["training.objective=reward", "data.format=preference", "training.reward_center_coefficient=-1"],
     "training.reward_center_coefficient"),
    (["training.objective=reward", "data.format=preference", "adapter.modules_to_save=[lm_head]"],
     "adapter.modules_to_save: lm_head: a reward model loads no language-model head"),
    (["training.objective=reward", "data.format=preference", "adapter.modules_to_save=[score,model.LM_HEAD]"],
     "adapter.modules_to_save: lm_head"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_contradictory_recipes_are_refused_naming_the_field(overrides, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.load("recipes/tiny.yaml", overrides)


def test_the_model_is_a_sequence_classifier_whose_score_head_trains_beside_the_adapter():
    from workbench.model.loading import attach_adapter, load_base_model

    recipe = Recipe.load("recipes/tiny-reward.yaml", ["model.dtype=float32", "training.mixed_precision=no"])
    torch.manual_seed(0)
    model = attach_adapter(load_base_model(recipe), recipe)
    assert type(model.base_model.model).__name__ == "LlamaForSequenceClassification"
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(n.endswith("score.modules_to_save.default.weight") for n in trained)
    assert all("lora_" in n or ".score." in n for n in trained)


def test_the_estimate_leaves_out_the_lm_head_and_its_logits():
    from workbench.estimator.memory import estimate

    pairs = Recipe.load("recipes/tiny-reward.yaml", ["training.objective=orpo", "data.max_seq_len=256"])
    reward = pairs.override("training.objective=reward")
    rows = {name: next(s for s in estimate(r, device="cpu").strategies if s["name"] == "single")["breakdown"]
            for name, r in (("orpo", pairs), ("reward", reward))}
    from workbench.spec.model_configs import describe_model

    info = describe_model("builtin:tiny")
    head = next(lin for lin in info.linears if lin.name == info.head)
    assert not info.tied_embeddings  # builtin:tiny's head has a matrix of its own: the reward model leaves it
    assert rows["orpo"]["weights"] - rows["reward"]["weights"] in (head.in_features * head.out_features * b
                                                                   for b in (2, 4))
    assert rows["reward"]["activations"] < rows["orpo"]["activations"]


def test_a_pair_that_truncation_cuts_is_left_out_and_counted(tmp_path, tiny_tokenizer, monkeypatch):
    """A reward is read at a sample's last token: in a cut answer that is mid-answer, so a reward model leaves the
    pair out (other objectives train on what truncation keeps)."""
    from workbench.data.prepared import prepare_data
    from workbench.spec.recipe import DataSection

    monkeypatch.setenv("LORA_WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "pairs.jsonl"
    long = {**PAIR, "chosen": "2 plus 3 is " + "very " * 60 + "much 5."}
    path.write_text("\n".join(json.dumps(r) for r in (PAIR, long, PAIR)) + "\n")
    cfg = DataSection(train=str(path), format="preference", max_seq_len=64, packing=False)
    kept = prepare_data(cfg, tiny_tokenizer, whole_only=True)
    assert len(kept.train) == 2 and kept.stats["train_cut"] == 1 and kept.stats["train_truncated"] == 1
    assert len(prepare_data(cfg, tiny_tokenizer).train) == 3  # the other objectives train on what is kept


# -- training ---------------------------------------------------------------------------------------------------


def reward_run(tmp_path, *extra):
    from workbench import train

    recipe = Recipe.load("recipes/tiny-reward.yaml", [
        f"output.dir={tmp_path}/{{name}}", "training.threads=1", "model.dtype=float32",
        "training.mixed_precision=no", *extra])
    return train(recipe, progress_bar=False)


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return reward_run(tmp_path_factory.mktemp("reward"))


@pytest.mark.slow
def test_held_out_accuracy_grows_and_evaluate_reports_it(trained):
    from workbench.outputs.evaluation import evaluate, format_evaluation

    evals = [r for r in rows_of(trained.run_dir) if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    assert trained.summary["objective"] == "reward" and trained.summary.get("samples") is None
    assert last["eval_loss"] < first["eval_loss"] - 0.1, (first, last)
    # a score head drawn at random on a tiny model: about 3 held-out pairs in 4 ranked right after 3 epochs
    assert last["eval_reward_accuracy"] >= 0.65 and last["eval_reward_margin"] > first["eval_reward_margin"] + 0.5
    train_rows = [r for r in rows_of(trained.run_dir) if "loss" in r]
    assert {"rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"} <= set(train_rows[-1])

    report = evaluate(trained.run_dir)
    assert report["rows"] == 24 and report["objective"] == "reward" and report["base"] is None
    # the same pairs as training's evaluation, scored by the saved adapter loaded the standard way
    assert report["tuned"]["reward_margin"] == pytest.approx(last["eval_reward_margin"], rel=1e-3)
    assert report["tuned"]["reward_accuracy"] == pytest.approx(last["eval_reward_accuracy"], abs=1e-4)
    assert "reward_accuracy" in format_evaluation(report)
    card = (trained.run_dir / "adapter" / "README.md").read_text()
    assert "a reward model" in card and "AutoModelForSequenceClassification" in card


@pytest.mark.slow
def test_the_saved_adapter_is_a_standard_sequence_classifier_adapter(trained):
    """transformers + peft load it as any sequence-classification adapter; a sample alone, rendered as the model
    card says, scores what training scored it at; the merged folder is a plain classifier that scores the same."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from workbench.data.tokens import tokenize_pair, tokenize_row
    from workbench.data.batches import Collator
    from workbench.outputs.merging import merge
    from workbench.model.loading import resolve_model_path
    from workbench.training.objectives import sequence_rewards

    adapter = trained.run_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForSequenceClassification.from_pretrained(resolve_model_path("builtin:tiny"), num_labels=1,
                                                              pad_token_id=tokenizer.pad_token_id)
    model = PeftModel.from_pretrained(base, adapter).eval()

    cfg = Recipe.load(trained.run_dir / "recipe.yaml").data
    chosen, rejected = tokenize_pair(PAIR, tokenizer, cfg, "x:1")
    conversation = [{"role": "user", "content": PAIR["prompt"]}, {"role": "assistant", "content": PAIR["chosen"]}]
    card_ids = tokenizer.apply_chat_template(conversation, return_dict=True)["input_ids"]
    assert card_ids == chosen["input_ids"]  # the model card's recipe renders a conversation as training does
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0, 0] for s in (chosen, rejected)]
        batch = Collator(tokenizer.pad_token_id)([tokenize_row(PAIR, tokenizer, cfg, "x:1")])
        ours = sequence_rewards(model, batch, tokenizer.pad_token_id)
    assert ours.tolist() == pytest.approx([float(r) for r in alone], abs=1e-5)

    folder = merge(trained.run_dir, dtype="fp32")
    merged = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    from workbench.model.inference import generate

    with pytest.raises(WorkbenchError, match="holds a classifier .*LlamaForSequenceClassification"):
        generate(folder, "What is 2 plus 3?")  # loaded as a language model, it would write noise
    with torch.no_grad():
        assert float(merged(input_ids=torch.tensor([chosen["input_ids"]])).logits[0, 0]) == pytest.approx(
            float(alone[0]), abs=1e-4)


@pytest.mark.slow
def test_commands_that_need_an_lm_head_are_refused_in_one_line(trained, capsys):
    from workbench.frontends.cli import main
    from workbench.model.inference import generate

    with pytest.raises(WorkbenchError, match="a reward model .* scores answers and writes none"):
        generate(trained.run_dir, "What is 2 plus 3?")
    assert main(["export", str(trained.run_dir)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "a reward model" in errors[0] and "score head" in errors[0]
    assert not (trained.run_dir / "gguf").exists()


@pytest.mark.slow
def test_a_data_driven_init_leaves_the_score_head_out(tmp_path):
    """CorDA decomposes the inputs of every targeted linear layer; the score head is trained whole, not a target."""
    result = reward_run(tmp_path, "adapter.init=corda", "training.max_steps=2", "output.eval_every=null")
    assert result.summary["steps"] == 2
    config = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    assert "score" not in (config["target_modules"] or []) and "score" in config["modules_to_save"]


@pytest.mark.slow
def test_a_resumed_reward_run_equals_an_uninterrupted_one(tmp_path):
    steps = ["training.max_steps=6", "output.save_every=3", "output.log_every=1", "output.eval_every=null"]
    whole = reward_run(tmp_path / "whole", *steps)
    cut = tmp_path / "cut" / "tiny-reward"
    shutil.copytree(whole.run_dir, cut)
    run = RunDir(cut)
    shutil.rmtree(run.checkpoint(6))
    shutil.rmtree(cut / "adapter")
    run.update_json(summary={"status": "running"})
    resumed = reward_run(tmp_path / "cut", *steps, "training.resume=auto")
    keys = ("loss", "reward_margin", "reward_accuracy")
    assert [r[k] for r in rows_of(resumed.run_dir) if "loss" in r for k in keys] == pytest.approx(
        [r[k] for r in rows_of(whole.run_dir) if "loss" in r for k in keys], rel=1e-5, abs=1e-7)


def test_the_data_preview_shows_what_a_reward_model_scores():
    """`workbench data` on a reward recipe: each sequence scored at its last token (the rest is context), pairs that
    truncation cut left out and counted, as training does (not the whole answers an SFT or DPO run trains on)."""
    preview = preview_data(Recipe.load("recipes/tiny-reward.yaml").override("data.max_seq_len=40"), rows=20)
    samples = [sample for _, pair in preview.rows for sample in pair]
    whole = [s for s in samples if not s.truncated]
    assert whole and all(s.targets == 1 and [t for _, t in s.spans] == [False, True] for s in whole)
    assert all(len(s.spans[-1][0]) <= 2 for s in whole)  # one token (a newline or the end token), not the answer
    cut = [s for s in samples if s.truncated]
    assert cut and all(s.left_out and s.targets == 0 for s in cut)
    stats = preview.stats
    assert stats["train_cut"] > 0 and stats["target_tokens"] == 2 * stats["examples"]
    assert "scored (the last token of each sequence" in preview.summary_lines()[0]
    assert whole[0].title("x").endswith("tokens, reward read at its last token") and "trained" not in preview.to_text()
    assert type(preview).from_json(preview.to_json()).rows[0][1][0].scored  # the UI's copy says the same
    # every pair cut: refused as training refuses it, naming the limit
    with pytest.raises(WorkbenchError, match="every example is longer than data.max_seq_len=30"):
        preview_data(Recipe.load("recipes/tiny-reward.yaml").override("data.max_seq_len=30"))

"""Pipeline parallel (`distributed.strategy: pp`): each process holds a run of consecutive decoder layers (a stage)
and torch.distributed.pipelining runs the step's micro-batches through the stages. Here, in one process: the
layer split, the stages chained by hand against the whole model, the padding, what is refused, and the estimate.
Against one process for real (gloo, 2 processes): tests/test_strategy_matrix.py, and the GPipe run below (slow)."""

import copy

import pytest
import torch

from test_distributed import RECIPE, adapter, assert_close_adapters, launch, losses
from workbench import Recipe, RecipeError, train
from workbench.data.tokens import IGNORE
from workbench.model import pipeline_stages
from workbench.spec.strategies import PP, layout_of, layout_problem

PP_READY = ["data.eval=null"]  # what strategy pp asks of the tiny recipe (evaluation is refused, below)


@pytest.mark.parametrize("layers, stages, split", [
    (2, 2, [[0], [1]]),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),  # the remainder to the earlier stages
    (4, 4, [[0], [1], [2], [3]]),
])
def test_the_layers_are_split_evenly_earlier_stages_taking_the_remainder(layers, stages, split):
    assert [list(r) for r in pipeline_stages.layer_split(layers, stages)] == split


def test_fewer_layers_than_stages_is_refused_naming_the_model():
    with pytest.raises(RecipeError, match="model.path: m has 2 decoder layers, fewer than the 3 pipeline stages"):
        pipeline_stages.check_stages("m", 2, 3, 4, "1f1b")


def test_workbench_launch_refuses_a_1f1b_pipeline_short_of_micro_batches_before_any_process_starts(capsys):
    """The process count is the launch's: it says so in one line (exit 2), not each rank after it started."""
    from workbench.frontends.cli import main

    assert main(["launch", RECIPE, "--nproc", "2", "distributed.strategy=pp", *PP_READY,
                 "training.grad_accum=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: training.grad_accum: 1 micro-batches a step, fewer than the 2") and "\n" not in err


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_naming_grad_accum():
    with pytest.raises(RecipeError, match="training.grad_accum: 1 micro-batches a step, fewer than the 2 pipeline"):
        pipeline_stages.check_stages("m", 2, 2, 1, "1f1b")
    pipeline_stages.check_stages("m", 2, 2, 1, "gpipe")  # GPipe runs it (most of it bubble)


@pytest.mark.parametrize("overrides, field", [
    (["adapter.method=qlora"], "adapter.method: qlora under strategy pp"),
    (["adapter.method=dora"], "adapter.method: dora under strategy pp"),
    (["adapter.method=full"], "adapter.method: full under strategy pp"),
    (["training.objective=dpo", "data.format=preference", "data.train=recipes/data/preference_train.jsonl"],
     "training.objective: dpo under strategy pp"),
    (["training.optimizer=adamw_8bit"], "training.optimizer: adamw_8bit under strategy pp"),
    (["adapter.init=pissa"], "adapter.init: pissa under strategy pp"),
    (["data.eval=recipes/data/tiny_chat_eval.jsonl"], "data.eval: evaluation under strategy pp"),
    (["output.sample_prompts=[hi]"], "output.sample_prompts: generation needs the whole model"),
])
def test_what_pipeline_parallel_does_not_run_yet_is_refused_naming_the_field(overrides, field):
    recipe = Recipe.load(RECIPE, [*PP_READY, *overrides])  # (strategy auto: checked against the layout below)
    assert layout_problem(recipe, PP).startswith(field)
    assert layout_problem(Recipe.load(RECIPE, PP_READY), PP) is None
    with pytest.raises(RecipeError, match=field.split(":")[0]):  # a recipe naming pp is refused as it loads
        Recipe.load(RECIPE, [*PP_READY, *overrides, "distributed.strategy=pp"])


def test_the_schedule_is_checked_naming_the_field():
    with pytest.raises(RecipeError, match="distributed.pipeline.schedule"):
        Recipe.load(RECIPE, [*PP_READY, "distributed.strategy=pp", "distributed.pipeline.schedule=interleaved"])
    assert Recipe.load(RECIPE, [*PP_READY, "distributed.pipeline.schedule=gpipe"]).distributed.pipeline.schedule \
        == "gpipe"


def test_one_process_cannot_pipeline():
    recipe = Recipe.load(RECIPE, [*PP_READY, "distributed.strategy=pp", "training.max_steps=1"])
    assert layout_of(recipe, 2) == PP and not PP.reads_own_batches and PP.batch_streams(2) == 1
    assert not PP.keeps_engine_state
    with pytest.raises(RecipeError, match="distributed.strategy: pp shards across processes, but this run has one"):
        train(recipe, progress_bar=False)


def test_a_model_that_is_not_llama_like_is_refused_naming_model_path():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    with pytest.raises(RecipeError, match=r"model.path: gpt2-like \(GPT2LMHeadModel\) is not a Llama-like decoder"):
        pipeline_stages.keep_stage(gpt2, 0, 2, "gpt2-like")


def _tiny_with_lora():
    from workbench.model.loading import attach_adapter, load_base_model

    recipe = Recipe.load(RECIPE, ["model.dtype=float32", "adapter.dropout=0.0"])
    torch.manual_seed(0)
    model = attach_adapter(load_base_model(recipe), recipe, None)
    with torch.no_grad():  # B is zero at init: give the adapter something to change
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model


@pytest.mark.parametrize("chunked", [True, False])
def test_two_stages_chained_by_hand_give_the_whole_models_loss_and_gradients(chunked):
    """Stage 0 (embeddings, layer 0) then stage 1 (layer 1, norm, head): the loss and every LoRA gradient of the
    whole model, each parameter under its own name; the other stage's modules are emptied and frozen."""
    from workbench.model.lm_loss import full_logits_loss_sum

    whole = _tiny_with_lora()
    stages = [copy.deepcopy(whole), copy.deepcopy(whole)]
    modules = [pipeline_stages.keep_stage(model, i, 2) for i, model in enumerate(stages)]
    ids = torch.randint(3, 1000, (2, 12))
    positions = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)  # two packed samples a row
    labels = torch.where(torch.rand(2, 12) < 0.3, IGNORE, torch.randint(3, 1000, (2, 12)))
    expected = full_logits_loss_sum(whole, {"input_ids": ids, "position_ids": positions, "labels": labels})
    expected.backward()
    hidden = modules[0](ids, positions)
    received = hidden.detach().requires_grad_()
    loss = pipeline_stages.head_loss_sum(pipeline_stages.causal_lm_of(stages[1]), modules[1](received, positions),
                                         labels, chunked)
    loss.backward()
    hidden.backward(received.grad)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    grads = {name: p.grad for name, p in whole.named_parameters() if p.requires_grad}
    for i, model in enumerate(stages):
        own = {name: p for name, p in model.named_parameters() if p.requires_grad}
        assert own and all(f"layers.{i}." in name for name in own)  # names as in the whole model
        for name, p in own.items():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6)
        assert sum(p.numel() for p in model.parameters()) < 0.6 * sum(p.numel() for p in whole.parameters())


def test_a_steps_micro_batches_are_padded_to_one_shape_without_changing_their_targets():
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "position_ids": torch.tensor([[0, 1, 0]]),
             "labels": torch.tensor([[6, IGNORE, IGNORE]])}
    out = pipeline_stages.padded(batch, 2, 5, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0, 0], [0, 0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]  # the last sample continues
    assert (out["labels"] != IGNORE).sum() == 1 and out["labels"][0, 0] == 6


@pytest.mark.parametrize("schedule, in_flight", [("1f1b", 2), ("gpipe", 4)])
def test_the_estimate_holds_the_largest_stage_and_the_micro_batches_in_flight(schedule, in_flight):
    from workbench.estimator.memory import estimate, pipeline_bubble, pipeline_stage_bytes

    recipe = Recipe.load(RECIPE, [*PP_READY, "training.grad_accum=4", f"distributed.pipeline.schedule={schedule}",
                                  "distributed.strategy=pp"])  # (its bubble is noted for a recipe that asks for pp)
    est = estimate(recipe, world_size=2, device="cpu")
    rows = {s["name"]: s for s in est.strategies}
    t = est.terms
    stage = pipeline_stage_bytes(t, 2)
    # builtin:tiny: 2 layers, one a stage; untied embeddings and head of equal size, so the stages weigh the same
    first = t["weights"] * (t["pp_layers_share"] / 2 + t["pp_embedding_share"])
    assert rows["pp"]["breakdown"]["weights"] == pytest.approx(first, rel=1e-3)
    assert rows["pp"]["breakdown"]["adapter"] == pytest.approx(rows["ddp"]["breakdown"]["adapter"] / 2, abs=1)
    per_layer = t["saved_activations"] / 2
    expected_first = in_flight * per_layer + 4 * t["pp_boundary"]  # 1F1B: a micro-batch a stage in flight
    expected_last = (4 if schedule == "gpipe" else 1) * (per_layer + t["logits_and_loss"]) + 4 * t["pp_boundary"]
    assert stage["activations"] == pytest.approx(max(expected_first, expected_last), rel=1e-3)
    if schedule == "gpipe":  # every micro-batch in flight: more than 1F1B keeps
        assert stage["activations"] > pipeline_stage_bytes({**t, "pp_gpipe": 0}, 2)["activations"]
    assert pipeline_bubble(2, 4) == pytest.approx(1 / 5)
    assert (f"pp: each stage idles about 20% of a step while the pipeline fills and drains (2 stages over 4 "
            f"micro-batch(es), {schedule}") in est.to_text(width=300).replace("\n", " ")


def test_where_only_splitting_the_layers_fits_the_estimate_says_which_and_at_what_cost():
    """Long sequences without checkpointing: every data-parallel layout (FSDP and ZeRO-3 included) holds a whole
    micro-batch's activations on each device; tensor parallel splits the heads' and the MLP's share of them, a
    pipeline stage holds its own layers'. Between the two, the estimate names the layouts that fit, what each
    costs, and a data-parallel recipe is told nothing of pipelines otherwise."""
    from workbench.estimator.memory import estimate

    recipe = Recipe.load("recipes/tiny.yaml", ["training.fast_paths=false", "data.max_seq_len=1024",
                                               "training.micro_batch_size=16", "training.gradient_checkpointing=false"])
    rows = {s["name"]: s["per_device_bytes"] for s in estimate(recipe, world_size=2, device="H100").strategies}
    data_parallel = min(v for k, v in rows.items() if k not in ("tp", "pp"))
    assert max(rows["tp"], rows["pp"]) < data_parallel
    between = (max(rows["tp"], rows["pp"]) + data_parallel) // 2
    est = estimate(recipe, world_size=2, device="H100", device_memory=between)
    note = next(n for n in est.notes if n.startswith("Only the layouts that split the layers fit"))
    assert "tp at" in note and "inside one machine" in note and "pp at" in note and "idles about" in note
    assert est.recommended == "tp"  # auto's last candidate; it never chooses a pipeline
    roomy = estimate(recipe, world_size=2, device="H100")
    assert not any("layouts that split the layers" in n or "idles about" in n for n in roomy.notes)


@pytest.mark.slow
def test_gpipe_follows_one_process(tmp_path):
    """The GPipe schedule on 2 stages (the strategy matrix runs 1F1B): one process's losses and adapter."""
    overrides = [*PP_READY, "training.grad_accum=2", "training.micro_batch_size=2", "output.save_every=null"]
    one = launch(tmp_path / "one", *overrides, nproc=1)
    two = launch(tmp_path / "pp", *overrides, "distributed.strategy=pp", "distributed.pipeline.schedule=gpipe")
    assert (one["world_size"], two["world_size"], two["layout"]["name"]) == (1, 2, "pp")
    assert losses(tmp_path / "pp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert_close_adapters(adapter(tmp_path / "pp"), adapter(tmp_path / "one"), atol=2e-5)

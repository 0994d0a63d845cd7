"""Tensor parallel (`distributed.strategy: tp`): every process holds a slice of each decoder layer's linear weights
(transformers' tp_plan) and of their LoRA factors (peft places them), and all of them compute one batch together.
Against one process, for real (gloo, 2 processes on a CPU); what it does not run yet is refused naming the field."""

import math

import pytest
import torch

from test_distributed import COMMON, RECIPE, adapter, assert_close_adapters, launch, losses
from workbench import Recipe, RecipeError, train
from workbench.spec.strategies import TP, layout_problem

# what strategy tp asks of a recipe today (the refusals below say why)
TP_READY = ["training.fast_paths=false"]


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_lora_draws_repeated_on_whole_shapes_are_pefts_own(init):
    """Under tensor parallel peft would draw each split factor on its slice: the workbench repeats peft's draws on
    the whole shapes. In one process the repetition must give exactly peft's factors and leave the random stream
    where peft left it (a peft that draws otherwise fails here, not silently in a run)."""
    from peft import LoraConfig, get_peft_model

    from workbench.model.loading import load_base_model
    from workbench.model.tensor_parallel import draw_as_one_process

    torch.manual_seed(42)
    base = load_base_model(Recipe.load(RECIPE, ["model.dtype=float32"]))
    before = torch.get_rng_state()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=init))
    after = torch.get_rng_state()
    pefts = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_A" in name}
    draw_as_one_process(model, before, init)
    assert pefts and all(torch.equal(p, dict(model.named_parameters())[name]) for name, p in pefts.items())
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("overrides, field", [
    (["adapter.method=qlora"], "adapter.method: qlora under strategy tp: bitsandbytes' 4-bit weights"),
    (["adapter.method=dora"], "adapter.method: dora under strategy tp"),
    (["training.fast_paths=true"], "training.fast_paths: its per-sample attention"),
    (["training.optimizer=adamw_8bit"], "training.optimizer: adamw_8bit keeps bitsandbytes' quantized states"),
    (["training.objective=dpo", "data.format=preference", "data.train=recipes/data/preference_train.jsonl",
      "data.eval=null"], "training.objective: dpo under strategy tp"),
    (["adapter.init=pissa"], "adapter.init: pissa reads whole weights"),
])
def test_what_tensor_parallel_does_not_run_yet_is_refused_naming_the_field(overrides, field):
    # refused as the recipe loads (`workbench validate`, and `launch` before any process starts)
    with pytest.raises(RecipeError) as refused:
        Recipe.load(RECIPE, ["distributed.strategy=tp", *TP_READY, *overrides])
    assert str(refused.value).startswith(f"{RECIPE}: {field}") and "\n" not in str(refused.value)
    assert layout_problem(Recipe.load(RECIPE, ["distributed.strategy=tp", *TP_READY]), TP) is None


def test_one_process_cannot_split_layers():
    with pytest.raises(RecipeError, match="distributed.strategy: tp shards across processes, but this run has one"):
        train(Recipe.load(RECIPE, ["distributed.strategy=tp", *TP_READY, "training.max_steps=1"]), progress_bar=False)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_estimate_splits_the_layers_weights_the_larger_lora_factor_and_the_heads_activations(checkpointing):
    """8B in bfloat16 on two processes: the decoder layers' weights halve, the embeddings and head stay whole; of
    each LoRA pair the larger factor halves; of what a layer keeps for backward, the heads' and the MLP's share
    halves, and a checkpointed layer's input (held whole by every process) does not."""
    from workbench.estimator.memory import _strategy, estimate
    from workbench.hardware.catalogue import get_device
    from workbench.spec.strategies import DDP

    recipe = Recipe.load("recipes/llama3.1-8b-qlora.yaml", ["adapter.method=lora", "quantization=null",
                                                              "model.dtype=bfloat16",
                                                              f"training.gradient_checkpointing={checkpointing}"])
    est = estimate(recipe, world_size=2, device="H100")
    dev = get_device("H100")
    whole, split = (_strategy(layout, est.terms, dev, 2, 1)["breakdown"] for layout in (DDP, TP))
    share = est.terms["tp_split_weights"]
    assert 0.8 < share < 0.95  # 32 layers of 218 M weights in 8.0 B: the rest is the 128k vocabulary's
    assert split["weights"] == math.ceil(whole["weights"] * (1 - share / 2))
    assert split["adapter"] < whole["adapter"] and split["optimizer"] < whole["optimizer"]
    heads_and_mlp = est.terms["tp_split_saved_activations"]
    if checkpointing:
        assert heads_and_mlp == 0 and split["activations"] == whole["activations"]
    else:  # q/k/v/o and the 14,336-wide MLP outweigh the norms and the 4,096-wide inputs q/k/v/gate/up read
        assert 0.6 < heads_and_mlp / est.terms["saved_activations"] < 0.95
        assert whole["activations"] - split["activations"] == heads_and_mlp - math.ceil(heads_and_mlp / 2)


@pytest.mark.slow
def test_two_tensor_parallel_processes_train_as_one(tmp_path):
    """Two processes, one batch stream: the losses, the held-out loss and the saved adapter (gathered whole into a
    standard PEFT file) are the one-process run's; each process held less than the whole model."""
    extra = [*TP_READY, "data.eval=recipes/data/tiny_chat_eval.jsonl", "output.eval_every=3",
             "training.grad_accum=2", "training.micro_batch_size=2"]
    one = train(Recipe.load(RECIPE, [f"output.dir={tmp_path}/one", *COMMON, *extra]), progress_bar=False)
    split = launch(tmp_path / "tp", *extra, "distributed.strategy=tp")
    assert split["layout"]["name"] == "tp" and split["distributed_type"] == "MULTI_GPU"
    assert losses(tmp_path / "tp") == pytest.approx(losses(one.run_dir), rel=1e-5)
    assert split["eval_loss_final"] == pytest.approx(one.summary["eval_loss_final"], rel=1e-5)
    assert_close_adapters(adapter(tmp_path / "tp"), adapter(one.run_dir), atol=2e-5)
    whole = one.summary["param_elements_per_rank"][0]
    assert all(held < whole for held in split["param_elements_per_rank"])

"""Each adapter method and memory saver really trains, saves, reloads and resumes."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench import Recipe, merge, train
from workbench.model.loading import attach_adapter, bnb_config, load_base_model
from workbench.rundir.runs import RunDir

ROOT = Path(__file__).resolve().parents[1]


def method_recipe(name, tmp_path, *extra):
    return Recipe.load(ROOT / f"recipes/{name}.yaml").override(
        f"output.dir={tmp_path}/{{name}}", "training.max_steps=8", "output.save_every=8", "output.eval_every=null",
        "output.log_every=1", "training.threads=1", *extra)  # precision: the recipe's auto


def checkpoint_model(recipe, run_dir, step):
    """The model as it was in training at `step`, rebuilt from the checkpoint's trainable weights."""
    model = attach_adapter(load_base_model(recipe), recipe)
    state = load_file(str(run_dir / "checkpoints" / f"step-{step}" / "model.safetensors"))
    _, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and state
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.slow
@pytest.mark.both_precisions
@pytest.mark.parametrize("name, atol", [("tiny-dora", 1e-5), ("tiny-qlora", 2e-2), ("tiny-rslora", 1e-5)])
def test_adapter_methods_train_and_reload_with_plain_peft(name, atol, tmp_path, cpu_precision):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe = method_recipe(name, tmp_path)
    result = train(recipe, progress_bar=False)
    losses = result.metrics["loss"].dropna().tolist()
    assert losses[-1] < losses[0] - 0.2, losses
    recipe = Recipe.load(result.run_dir / "recipe.yaml")  # what ran: `auto` precision resolved

    config = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] == (recipe.adapter.method == "dora") and config["use_rslora"] == recipe.adapter.rslora
    kwargs = {"quantization_config": bnb_config(recipe), "device_map": {"": "cpu"}} if recipe.quantization else {}
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"],
                                                dtype=getattr(torch, recipe.model.dtype), **kwargs)
    plain = PeftModel.from_pretrained(base, result.run_dir / "adapter").eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    expected = logits(checkpoint_model(recipe, result.run_dir, 8), ids)
    assert torch.allclose(logits(plain, ids), expected, atol=atol)


@pytest.mark.slow
@pytest.mark.both_precisions
def test_full_fine_tuning_saves_a_whole_model(tmp_path, cpu_precision):
    from transformers import AutoModelForCausalLM

    recipe = method_recipe("tiny-full", tmp_path)
    result = train(recipe, progress_bar=False)
    assert result.summary["trainable_params"] == result.summary["params"]
    assert not (result.run_dir / "adapter").exists()
    # The saved model is what trained, in the dtype it trained in (bf16 where this CPU computes bf16 natively):
    # loaded as saved it holds the checkpoint's weights bit for bit and computes the same logits. (Loading it
    # upcast to float32 would compare float32 arithmetic against bf16, not the save.)
    saved = AutoModelForCausalLM.from_pretrained(result.run_dir / "model", dtype="auto").eval()
    trained = checkpoint_model(recipe, result.run_dir, 8)
    assert str(saved.dtype).removeprefix("torch.") == result.summary["model_dtype"]
    trained_weights = trained.state_dict()
    for name, tensor in saved.state_dict().items():
        assert tensor.dtype == trained_weights[name].dtype and torch.equal(tensor, trained_weights[name]), name
    ids = torch.arange(3, 40).unsqueeze(0)
    assert torch.equal(logits(saved, ids), logits(trained, ids))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_resumes_from_a_checkpoint(tmp_path, bits):
    # No eval: bitsandbytes repacks 4-bit weights for its CPU inference kernel at the first no-grad
    # forward, after which training runs a different (equally valid) kernel; an eval at step 0 that
    # the resumed run skips would make the two runs differ in the last float digits.
    # 8-bit layers add state-dict keys (SCB) that are no attributes: the checkpoint must still be written.
    recipe = method_recipe("tiny-qlora", tmp_path, "training.max_steps=6", "output.save_every=3",
                           "output.keep_last=2", "data.eval=null", f"quantization.bits={bits}")
    whole = train(recipe, progress_bar=False)
    crashed = recipe.override(f"output.dir={tmp_path}/crashed")
    shutil.copytree(whole.run_dir, crashed.run_dir)
    shutil.rmtree(crashed.run_dir / "checkpoints" / "step-6")
    shutil.rmtree(crashed.run_dir / "adapter")
    RunDir(crashed.run_dir).update_json(summary={"status": "running"})  # as a killed run leaves it
    resumed = train(crashed, resume=True, progress_bar=False)
    a = load_file(str(whole.run_dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed.run_dir / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
def test_qlora_merges_into_a_dequantized_base(tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = method_recipe("tiny-qlora", tmp_path, "training.max_steps=4", "output.save_every=null")
    result = train(recipe, progress_bar=False)
    out = merge(result.run_dir, dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not hasattr(merged.config, "quantization_config")
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_qlora_keeps_the_unquantized_frozen_weights_in_the_model_dtype(tmp_path):
    """Embeddings, head and norms stay bfloat16 beside the 4-bit Linears (peft's k-bit preparation would make them
    float32); quantization.upcast_frozen brings that back. The estimator counts what the model holds."""
    from workbench.estimator.memory import weight_bytes
    from workbench.spec.model_configs import describe_model

    recipe = method_recipe("tiny-qlora", tmp_path, "model.dtype=bfloat16", "training.mixed_precision=no",
                           "quantization.compute_dtype=float32")
    held = {}
    for upcast in (False, True):
        r = recipe.override(f"quantization.upcast_frozen={str(upcast).lower()}")
        model = attach_adapter(load_base_model(r), r)
        frozen = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and type(p).__name__ != "Params4bit"}
        assert frozen == ({torch.float32} if upcast else {torch.bfloat16}), (upcast, frozen)
        packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
        assert packed and all(p.dtype == torch.uint8 and not p.requires_grad for p in packed)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
        held[upcast] = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
        info = describe_model(r.model.path)
        unquantized = sum(p.numel() for p in model.parameters() if type(p).__name__ != "Params4bit") - sum(
            p.numel() for n, p in model.named_parameters() if "lora_" in n)
        assert weight_bytes(r, info) - weight_bytes(recipe, info) == (2 * unquantized if upcast else 0)
    assert held[True] - held[False] == 2 * unquantized


def test_qlora_computing_in_float32_keeps_a_bf16_checkpoints_vocabulary_in_bf16(tmp_path, tiny_bf16_path):
    """Where a QLoRA model computes in float32 (a CPU without native bf16), the embeddings and head of a bf16
    checkpoint stay bf16 (precision.vocabulary_dtype_of): the same loss, gradients and logits as the float32
    upcast, and the estimator counts half the bytes for them."""
    from workbench.model.lm_loss import lm_loss_sum
    from workbench.estimator.memory import vocabulary_params, weight_bytes
    from workbench.spec.model_configs import describe_model

    recipe = method_recipe("tiny-qlora", tmp_path, f"model.path={tiny_bf16_path}", "model.dtype=float32",
                           "training.mixed_precision=no", "quantization.compute_dtype=float32")
    ids = torch.arange(3, 40)[None]
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None], "labels": ids.roll(-1, 1)}
    runs = {}
    for upcast in (False, True):
        r = recipe.override(f"quantization.upcast_frozen={str(upcast).lower()}")
        torch.manual_seed(0)
        model = attach_adapter(load_base_model(r), r)
        embeddings = model.get_input_embeddings().weight
        assert embeddings.dtype == (torch.float32 if upcast else torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():  # the adapter away from zero, so its gradients mean something
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * 0.05)
        loss = lm_loss_sum(model, batch)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            out = model(input_ids=ids).logits  # the model's own head: evaluation, generation
        assert out.dtype == torch.float32
        runs[upcast] = (loss.detach(), grads, out)
    torch.testing.assert_close(runs[False][0], runs[True][0], rtol=1e-5, atol=0)
    for lean, upcast in zip(runs[False][1], runs[True][1]):
        torch.testing.assert_close(lean, upcast, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(runs[False][2], runs[True][2], rtol=1e-5, atol=1e-5)
    info = describe_model(str(tiny_bf16_path))
    upcast = recipe.override("quantization.upcast_frozen=true")
    assert weight_bytes(upcast, info) - weight_bytes(recipe, info) == 2 * vocabulary_params(info)


def test_trained_copies_are_float32_under_autocast(tmp_path):
    """peft copies a modules_to_save module in the base's dtype; under autocast the workbench trains it in float32
    (AdamW on bf16 weights loses small updates), and without autocast it stays in the dtype the layers around it
    compute in, so the forward still runs."""
    for name in ("tiny", "tiny-qlora"):
        for mixed, expected in (("bf16", torch.float32), ("no", torch.bfloat16)):
            r = method_recipe(name, tmp_path, "model.dtype=bfloat16", f"training.mixed_precision={mixed}",
                              "adapter.modules_to_save=[lm_head]")
            model = attach_adapter(load_base_model(r), r)
            copies = [p for n, p in model.named_parameters() if "modules_to_save" in n]
            assert copies and all(p.dtype == expected and p.requires_grad for p in copies), (name, mixed)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed == "bf16"):
                assert model(input_ids=torch.arange(3, 20)[None]).logits.dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("model_dtype", ["bfloat16", "float32"])
def test_lean_qlora_trains_as_well_as_the_float32_upcast(tmp_path, tiny_bf16_path, model_dtype):
    """The memory the lean path saves costs no quality: eval loss within 1% of peft's float32-upcast path, with
    the model in bf16, and in float32 from a bf16 checkpoint (whose vocabulary then stays bf16)."""
    common = [f"model.dtype={model_dtype}", "training.mixed_precision=no", "quantization.compute_dtype=float32",
              "training.max_steps=10", "output.save_every=null", "output.eval_every=10",
              *([f"model.path={tiny_bf16_path}"] if model_dtype == "float32" else [])]
    evals = {}
    for upcast in ("false", "true"):
        result = train(method_recipe("tiny-qlora", tmp_path, *common, f"name=upcast-{upcast}",
                                     f"quantization.upcast_frozen={upcast}"), progress_bar=False)
        losses = result.metrics["eval_loss"].dropna().tolist()
        assert losses[-1] < losses[0] - 0.2, losses  # it learned
        evals[upcast] = losses[-1]
    assert evals["false"] == pytest.approx(evals["true"], rel=0.01), evals


def test_gradient_checkpointing_gives_the_same_losses(tiny_recipe):
    common = ["training.max_steps=3", "adapter.dropout=0.0"]
    plain = train(tiny_recipe.override(*common, "name=plain"), progress_bar=False)
    checkpointed = train(tiny_recipe.override(*common, "name=gc", "training.gradient_checkpointing=true"),
                         progress_bar=False)
    a = plain.metrics["loss"].dropna().tolist()
    b = checkpointed.metrics["loss"].dropna().tolist()
    assert a == pytest.approx(b, rel=1e-5)


def test_target_module_presets(tiny_recipe):
    from workbench.model.loading import count_parameters

    counts = {}
    for preset in ("attention", "mlp", "all-linear"):
        recipe = tiny_recipe.override(f"adapter.target_modules={preset}")
        model = attach_adapter(load_base_model(recipe), recipe)
        names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n}
        counts[preset] = (names, count_parameters(model)[1])
    assert counts["attention"][0] == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert counts["mlp"][0] == {"gate_proj", "up_proj", "down_proj"}
    assert counts["all-linear"][0] == counts["attention"][0] | counts["mlp"][0]  # lm_head excluded
    assert counts["all-linear"][1] == counts["attention"][1] + counts["mlp"][1]

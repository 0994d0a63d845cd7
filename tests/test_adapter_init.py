"""adapter.init and LoRA+: each init is peft's own for the same seed; an adapter trained from PiSSA/OLoRA is saved
converted and gives, on the published base, the model training ended with; a resumed run equals an uninterrupted
one; LoRA+ puts B at ratio x lr through the whole schedule and a resume with a new lr; bad input is one line."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from workbench import train
from workbench.base.errors import RecipeError, WorkbenchError
from workbench.frontends.cli import main
from workbench.model.loading import attach_adapter, load_base_model
from workbench.rundir.runs import RunDir
from workbench.spec.adapter_init import InitialAdapter, converted_config
from workbench.spec.model_configs import target_modules
from workbench.spec.recipe import Recipe

FP32 = ["model.dtype=float32", "training.mixed_precision=no", "training.threads=1"]


def tiny(*overrides: str, out=None) -> Recipe:
    return Recipe.load("recipes/tiny.yaml", [*FP32, *overrides, *([f"output.dir={out}"] if out else [])])


@pytest.mark.parametrize("init, peft_value", [("default", True), ("gaussian", "gaussian"), ("pissa", "pissa"),
                                              ("olora", "olora")])
def test_each_init_is_pefts_own_for_the_same_seed(init, peft_value):
    from peft import LoraConfig, get_peft_model

    recipe = tiny(f"adapter.init={init}")
    torch.manual_seed(0)
    ours = dict(attach_adapter(load_base_model(recipe), recipe).named_parameters())
    torch.manual_seed(0)
    a = recipe.adapter
    reference = get_peft_model(load_base_model(recipe), LoraConfig(
        r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=target_modules(a),
        init_lora_weights=peft_value, task_type="CAUSAL_LM"))
    theirs = dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    assert max(float((ours[k] - theirs[k]).detach().abs().max()) for k in ours) == 0.0  # base weights included (PiSSA's W_res)
    if init in ("pissa", "olora"):
        plain = dict(load_base_model(recipe).named_parameters())
        q_proj = next(k for k in ours if k.endswith("q_proj.base_layer.weight"))
        assert not torch.equal(ours[q_proj], plain[q_proj.replace("base_model.model.", "").replace(".base_layer", "")])


@pytest.mark.parametrize("init, rslora, targets", [
    ("pissa", False, "all-linear"), ("olora", True, "all-linear"),
    ("pissa", False, "[embed_tokens,q_proj,down_proj]"),  # the embedding's base stays as published
])
def test_a_converted_adapter_gives_the_trained_model_on_the_published_base(tmp_path, init, rslora, targets):
    from peft import PeftModel

    recipe = tiny(f"adapter.init={init}", f"adapter.rslora={str(rslora).lower()}", f"adapter.target_modules={targets}")
    torch.manual_seed(0)
    model = attach_adapter(load_base_model(recipe), recipe)
    start = InitialAdapter.of(model)
    with torch.no_grad():  # as training would: every adapter weight moved
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    model.eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        trained = model(ids).logits
    original = model.peft_config["default"]
    model.peft_config["default"] = converted_config(original)
    model.save_pretrained(tmp_path, state_dict=start.convert(model.state_dict()))
    model.peft_config["default"] = original
    loaded = PeftModel.from_pretrained(load_base_model(recipe), tmp_path).eval()
    assert loaded.peft_config["default"].r == 2 * recipe.adapter.r
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, trained, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_pissa_run_with_lora_plus_resumes_exactly_and_its_adapter_scores_what_training_measured(tmp_path):
    from workbench.outputs.evaluation import evaluate

    steps = ["adapter.init=pissa", "adapter.lora_plus_ratio=4", "training.max_steps=6", "output.save_every=3",
             "output.log_every=1", "output.eval_every=null", "adapter.dropout=0"]
    whole = train(tiny(*steps, out=tmp_path / "whole"), progress_bar=False)
    losses = [row["loss"] for row in _rows(whole.run_dir) if "loss" in row]
    assert losses[-1] < losses[0]
    # the saved adapter is converted: on the published base it scores the eval loss the run measured at its end
    report = evaluate(whole.run_dir)
    assert report["tuned"]["eval_loss"] == pytest.approx(whole.summary["eval_loss_final"], rel=1e-5)

    cut = tmp_path / "cut"
    shutil.copytree(whole.run_dir, cut)
    run = RunDir(cut)
    shutil.rmtree(run.checkpoint(6))
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})  # as a killed run leaves it
    resumed = train(tiny(*steps, out=cut), resume=True, progress_bar=False)
    a, b = load_file(str(whole.run_dir / "adapter/adapter_model.safetensors")), load_file(
        str(resumed.run_dir / "adapter/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def _rows(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


EMBEDDING_AND_LINEARS = "adapter.target_modules=[embed_tokens,q_proj,v_proj,down_proj]"


def _biased_base(recipe):
    """The tiny model with biases on its attention and MLP layers, which a module trained in full carries."""
    base = load_base_model(recipe)
    config = base.config
    config.attention_bias = config.mlp_bias = True
    torch.manual_seed(0)
    return type(base)(config)


@pytest.mark.parametrize("overrides, base", [
    ([], load_base_model),  # the Linears only
    ([EMBEDDING_AND_LINEARS], load_base_model),
    ([EMBEDDING_AND_LINEARS, "adapter.method=dora"], load_base_model),  # magnitudes on the embedding and Linears
    ([EMBEDDING_AND_LINEARS, "adapter.modules_to_save=[norm,o_proj]"], _biased_base),  # a norm, a bias, trained whole
])
def test_lora_plus_puts_every_parameter_at_pefts_rate_and_weight_decay(overrides, base):
    from peft.optimizers import create_loraplus_optimizer

    from workbench.training.parts import build_optimizer

    recipe = tiny("adapter.lora_plus_ratio=16", "training.lr=1e-4", "training.weight_decay=0.1",
                  "adapter.lora_plus_lr_embedding=3e-6", *overrides)
    torch.manual_seed(0)
    model = attach_adapter(base(recipe), recipe)
    theirs = create_loraplus_optimizer(model, torch.optim.AdamW, lr=1e-4, loraplus_lr_ratio=16,
                                       loraplus_lr_embedding=3e-6, loraplus_weight_decay=0.1).param_groups
    ours = build_optimizer(model, recipe).param_groups

    def settings(groups):
        names = {id(p): name for name, p in model.named_parameters()}
        return {names[id(p)]: (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}

    expected = settings(theirs)
    assert settings(ours) == expected
    assert len(expected) == sum(p.requires_grad for p in model.parameters())
    kinds = {kind: {expected[n] for n in expected if kind in n} for kind in ("lora_embedding_", "bias")}
    if overrides:  # the cases hold what each is there for: the embedding factors at their own rate, a bias
        assert kinds["lora_embedding_"] == {(3e-6, 0.1)}
    if base is _biased_base:
        assert kinds["bias"] == {(16e-4, 0.0)}


def test_lora_plus_keeps_its_rates_through_the_schedule_and_a_new_lr():
    from workbench.training.parts import build_optimizer, build_scheduler, set_peak_lr

    recipe = tiny("adapter.lora_plus_ratio=16", "training.lr=1e-4", EMBEDDING_AND_LINEARS)
    torch.manual_seed(0)
    model = attach_adapter(load_base_model(recipe), recipe)
    optimizer = build_optimizer(model, recipe)
    scheduler = build_scheduler(optimizer, recipe, total_steps=10)
    embedding = recipe.adapter.lora_plus_lr_embedding
    peaks = [g["lr"] for g in optimizer.param_groups]
    assert peaks == pytest.approx([1e-4, embedding, 16e-4])  # A, the embedding factors, B
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    rates = [g["lr"] for g in optimizer.param_groups]
    assert rates == pytest.approx([rates[0] * p / peaks[0] for p in peaks]) and rates[0] > 0
    set_peak_lr(scheduler, 5e-5)  # a resume that lowers the rate: the embedding factors keep theirs
    assert scheduler.base_lrs == pytest.approx([5e-5, embedding, 16 * 5e-5])
    rates = [g["lr"] for g in optimizer.param_groups]
    assert rates == pytest.approx([rates[0] * p / 5e-5 for p in scheduler.base_lrs]) and rates[0] > 0


def test_a_checkpoint_with_other_learning_rate_groups_is_refused_and_leaves_the_run_as_it_was(tmp_path):
    import hashlib
    import json

    whole = train(tiny("adapter.lora_plus_ratio=16", EMBEDDING_AND_LINEARS, "training.max_steps=2",
                       "output.save_every=2", "output.eval_every=null", out=tmp_path / "run"), progress_bar=False)
    run = RunDir(whole.run_dir)
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})  # as a killed run leaves it
    meta = run.checkpoint(2) / "workbench_checkpoint.json"
    written = json.loads(meta.read_text())
    # as LoRA+ wrote it before the embedding factors had a group of their own: A's rate and B's
    for key in ("base_lrs", "_last_lr"):
        written["scheduler"][key] = written["scheduler"][key][::2]
    meta.write_text(json.dumps(written))
    # the run's record of it as that version would have published it
    run.update_json(checkpoints={"2": hashlib.sha256(meta.read_bytes()).hexdigest()})
    before = {name: (run.path / name).read_bytes() for name in ("recipe.yaml", "run.json", "metrics.jsonl")}
    with pytest.raises(WorkbenchError, match=r"step-2 holds 2 learning-rate groups and this run 3 ") as refused:
        train(tiny("adapter.lora_plus_ratio=16", EMBEDDING_AND_LINEARS, "training.max_steps=2",
                   "output.save_every=2", "output.eval_every=null", out=tmp_path / "run"), resume=True,
              progress_bar=False)
    assert "\n" not in str(refused.value)
    assert {name: (run.path / name).read_bytes() for name in before} == before


@pytest.mark.parametrize("overrides, message", [
    (["adapter.init=loftq2"], "adapter.init: must be one of default, gaussian, pissa, olora, eva, corda, got .loftq2."),
    (["adapter.init=loftq"], "adapter.init: loftq is not offered: peft computes it on CUDA only"),
    (["adapter.init=corda", "adapter.method=qlora"], "adapter.init: corda rewrites the base weights"),
    (["adapter.init=eva", "adapter.method=dora"], "adapter.init: eva with DoRA is not supported"),
    (["adapter.init=eva", "distributed.strategy=deepspeed", "distributed.deepspeed.stage=3"],
     "adapter.init: eva runs forward passes over the training data at start-up, which ZeRO-3 has already"),
    (["adapter.lora_plus_ratio=0.5"], "adapter.lora_plus_ratio"),
    (["adapter.lora_plus_ratio=1e308"], "adapter.lora_plus_ratio: Input should be less than or equal to 1024"),
    (["adapter.lora_plus_ratio=true"], "adapter.lora_plus_ratio: expected a number such as 16, got True"),
    (["adapter.lora_plus_lr_embedding=true"], "adapter.lora_plus_lr_embedding: expected a number such as 1e-6"),
    (["adapter.lora_plus_lr_embedding=0"], "adapter.lora_plus_lr_embedding: Input should be greater than 0"),
    (["adapter.init=pissa", "adapter.method=qlora"], "adapter.init: pissa rewrites the base weights"),
    (["adapter.init=olora", "adapter.method=dora"], "adapter.init: olora with DoRA is not supported"),
    (["adapter.init=pissa", "adapter.modules_to_save=[lm_head]"], "adapter.modules_to_save is not supported"),
    (["adapter.lora_plus_ratio=4", "adapter.method=full"], "adapter.lora_plus_ratio: applies to LoRA adapters"),
    (["adapter.init=olora", "distributed.strategy=deepspeed", "distributed.deepspeed.stage=3"],
     "adapter.init: olora decomposes each whole weight at start-up, which ZeRO-3 has already partitioned"),
])
def test_bad_init_settings_are_one_line_naming_the_field(tmp_path, capsys, overrides, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace("[", r"\[")):
        tiny(*overrides)
    assert main(["train", "recipes/tiny.yaml", *overrides, f"output.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists(), err


def test_the_estimator_counts_a_decomposing_inits_start_up():
    from workbench.estimator.memory import estimate

    plain, pissa = estimate(tiny()), estimate(tiny("adapter.init=pissa"))
    assert plain.terms["init_flops"] == 0 and pissa.terms["init_flops"] > 0
    assert pissa.terms["initial_adapter"] == pissa.terms["adapter"]  # A0/B0: one more copy of the adapter
    assert pissa.strategies[0]["per_device_bytes"] > plain.strategies[0]["per_device_bytes"]
    assert any(note.startswith("adapter.init pissa: every target weight is decomposed") for note in pissa.notes)


def test_the_estimator_says_what_evas_start_up_reads():
    from workbench.estimator.memory import estimate

    eva = estimate(tiny("adapter.init=eva"))
    assert eva.terms["init_transient"] > 0 and eva.terms["initial_adapter"] == 0  # the base is untouched: no A0/B0
    assert any(note.startswith("adapter.init eva: forward passes over the first training micro-batches")
               for note in eva.notes)
    corda = estimate(tiny("adapter.init=corda"))
    assert corda.terms["init_flops"] > 0 and corda.terms["initial_adapter"] == corda.terms["adapter"]
    assert corda.terms["init_transient"] > 0  # the covariances, held together
    assert any(note.startswith("adapter.init corda: forward passes over the first 256 training rows")
               for note in corda.notes)


def test_dpo_after_an_init_that_rewrites_the_base_is_refused(tmp_path, capsys):
    """DPO's reference is the adapter switched off: after PiSSA that is the residual base, not the published model."""
    assert main(["train", "recipes/tiny-dpo.yaml", "adapter.init=pissa", f"output.dir={tmp_path}/run"]) == 2
    assert "adapter.init: pissa with objective dpo is not supported" in capsys.readouterr().err
    Recipe.load("recipes/tiny-dpo.yaml", ["adapter.init=pissa", "training.objective=orpo"])  # no reference: fine


def test_the_estimator_marks_a_layout_the_recipe_cannot_run():
    from workbench.estimator.memory import estimate

    est = estimate(tiny("adapter.init=olora"), world_size=2)
    refused = {s["name"]: s["refused"] for s in est.strategies if s["refused"]}
    assert set(refused) == {"zero3", "zero3_offload", "tp", "pp"} and est.recommended not in refused
    assert "zero3 refused: adapter.init: olora decomposes" in est.to_text(width=300)


# -- EVA: from the run's own data ----------------------------------------------------------------------


def eva_inputs(recipe):
    from workbench.data.prepared import prepare_data
    from workbench.data.batches import Collator, FirstEpochBatches
    from workbench.model.loading import load_tokenizer

    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.training.seed)
    return FirstEpochBatches(data.train, Collator(tokenizer.pad_token_id), recipe.training.micro_batch_size, 1, 0,
                             recipe.training.seed)


def test_eva_is_pefts_own_on_the_runs_first_batches():
    """The components, ranks and scalings of peft's EVA on the same micro-batches (unpacked rows: the model's own
    attention mask changes nothing there), and B = 0: the adapter starts as a no-op."""
    from peft import EvaConfig, LoraConfig, get_peft_model, initialize_lora_eva_weights

    from workbench.spec.adapter_init import EVA_RHO, initialize_eva

    recipe = tiny("adapter.init=eva", "data.packing=false", "data.limit=48")
    batches = eva_inputs(recipe)
    torch.manual_seed(0)
    ours = attach_adapter(load_base_model(recipe), recipe)
    components = initialize_eva(ours, batches)
    torch.manual_seed(0)
    a = recipe.adapter
    reference = get_peft_model(load_base_model(recipe), LoraConfig(
        r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=target_modules(a), init_lora_weights="eva",
        eva_config=EvaConfig(rho=EVA_RHO), task_type="CAUSAL_LM"))
    initialize_lora_eva_weights(reference, dataloader=list(batches), show_progress_bar=False)
    theirs = dict(reference.named_parameters())
    mine = dict(ours.named_parameters())
    assert mine.keys() == theirs.keys() and components
    assert max(float((mine[k] - theirs[k]).detach().abs().max()) for k in mine) < 1e-5
    assert ours.peft_config["default"].rank_pattern == reference.peft_config["default"].rank_pattern
    assert all(float(p.abs().max()) == 0 for k, p in mine.items() if ".lora_B." in k)


@pytest.mark.slow
def test_an_eva_run_trains_and_resumes_from_the_components_it_saved(tmp_path):
    from peft import PeftModel

    steps = ["adapter.init=eva", "data.limit=48", "training.max_steps=6", "output.save_every=3", "output.log_every=1",
             "output.eval_every=null", "adapter.dropout=0"]
    whole = train(tiny(*steps, out=tmp_path / "whole"), progress_bar=False)
    losses = [row["loss"] for row in _rows(whole.run_dir) if "loss" in row]
    assert losses[-1] < losses[0]
    saved = load_file(str(whole.run_dir / "eva_init.safetensors"))
    config = PeftModel.from_pretrained(load_base_model(tiny()), whole.run_dir / "adapter").peft_config["default"]
    assert config.rank_pattern and {v for v in config.rank_pattern.values()} <= set(range(1, 2 * config.r + 1))
    assert saved  # the components the run started from, by layer

    cut = tmp_path / "cut"
    shutil.copytree(whole.run_dir, cut)
    run = RunDir(cut)
    shutil.rmtree(run.checkpoint(6))
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})
    # the resume reads the saved components, not the data: a changed set of them would show here
    resumed = train(tiny(*steps, out=cut), resume=True, progress_bar=False)
    a, b = load_file(str(whole.run_dir / "adapter/adapter_model.safetensors")), load_file(
        str(resumed.run_dir / "adapter/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
    (cut / "eva_init.safetensors").unlink()
    shutil.rmtree(run.adapter)
    run.update_json(summary={"status": "running"})
    assert main(["train", str(cut / "recipe.yaml"), "--resume", "--no-progress"]) == 1


# -- CorDA: from the covariance of each target's inputs ---------------------------------------------------


def test_corda_is_pefts_own_on_the_runs_first_rows():
    """The residual base, A and B of peft's CorDA (instruction-previewed) from the same samples, one at a time (a
    packed row split where positions start again)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.config import CordaConfig
    from peft.tuners.lora.corda import preprocess_corda

    from workbench.spec.adapter_init import CORDA_ROWS, _samples_of
    from workbench.data.prepared import prepare_data
    from workbench.data.batches import first_rows
    from workbench.model.loading import load_tokenizer

    recipe = tiny("adapter.init=corda", "data.limit=64")
    data = prepare_data(recipe.data, load_tokenizer(recipe.model), seed=recipe.training.seed)
    rows = first_rows(data.train, recipe.training.seed, CORDA_ROWS)
    ours = dict(attach_adapter(load_base_model(recipe), recipe, rows).named_parameters())

    base, a = load_base_model(recipe), recipe.adapter
    names = sorted({k.split(".")[-4] for k in ours if ".lora_A." in k})
    config = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=names,
                        init_lora_weights="corda", corda_config=CordaConfig(corda_method="ipm"), task_type="CAUSAL_LM")

    def run_model():  # one sample at a time, as the workbench feeds packed rows to it
        for row in rows:
            for ids, positions in _samples_of(row):
                base(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=False)

    preprocess_corda(base, config, run_model=run_model)
    theirs = dict(get_peft_model(base, config).named_parameters())
    assert ours.keys() == theirs.keys()
    diffs = {k: float((ours[k] - theirs[k]).detach().abs().max()) for k in ours}
    assert max(diffs.values()) == 0.0, sorted(diffs.items(), key=lambda kv: -kv[1])[:4]  # W_res included
    plain = dict(load_base_model(recipe).named_parameters())
    q_proj = next(k for k in ours if k.endswith("q_proj.base_layer.weight"))
    assert not torch.equal(ours[q_proj], plain[q_proj.replace("base_model.model.", "").replace(".base_layer", "")])


@pytest.mark.slow
def test_a_corda_run_is_saved_for_the_published_base():
    """Trained from CorDA's residual base, the adapter is saved converted: on the published base it scores the eval
    loss the run measured at its end."""
    import tempfile

    from workbench.outputs.evaluation import evaluate

    with tempfile.TemporaryDirectory() as out:
        done = train(tiny("adapter.init=corda", "data.limit=64", "training.max_steps=4", "output.eval_every=null",
                          "adapter.dropout=0", out=f"{out}/run"), progress_bar=False)
        report = evaluate(done.run_dir)
        assert report["tuned"]["eval_loss"] == pytest.approx(done.summary["eval_loss_final"], rel=1e-5)


def test_eva_that_cannot_converge_is_one_line_not_an_endless_start(tmp_path, capsys):
    """Micro-batches shorter than EVA's components (2r) are skipped by peft, which cycles the data until every layer
    converges: refused up front, and peft's loop bounded besides."""
    from workbench.spec.adapter_init import EVA_MIN_FORWARDS, EVA_PASSES, initialize_eva
    from workbench.base.errors import WorkbenchError

    short = ["adapter.init=eva", "adapter.r=48", "training.micro_batch_size=1", "data.packing=false", "data.limit=16"]
    assert main(["train", "recipes/tiny.yaml", *short, f"output.dir={tmp_path}/run", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "adapter.init: eva computes 96 components per layer" in err[0], err
    assert not (tmp_path / "run").exists()

    recipe = tiny(*short)
    batches = eva_inputs(recipe)
    model = attach_adapter(load_base_model(recipe), recipe)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(1))
    budget = max(EVA_PASSES * len(batches), EVA_MIN_FORWARDS)
    with pytest.raises(WorkbenchError, match=f"did not converge within {budget} forward passes"):
        initialize_eva(model, batches)
    assert len(seen) == budget


def test_corda_reads_a_packed_row_one_sample_at_a_time():
    from workbench.spec.adapter_init import _samples_of

    row = {"input_ids": [5, 6, 7, 8, 9, 10], "position_ids": [0, 1, 2, 0, 1, 2]}
    assert list(_samples_of(row)) == [([5, 6, 7], [0, 1, 2]), ([8, 9, 10], [0, 1, 2])]
    pair = {"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 2, 2]}  # a rejected answer continuing its prompt
    assert list(_samples_of(pair)) == [([1, 2, 3, 4], [0, 1, 2, 2])]

"""The GPU path, checked on a CPU: the attention kernel each device and recipe get (workbench/model/attention.py), what
the estimator charges for each, and what the loop does differently on a GPU (no device read per step, page-locked
non-blocking copies, fused AdamW, compiled layers). FlexAttention's numbers are proven in tests/test_data.py."""

import os
import signal
import sys

import pytest
import torch

from workbench import Recipe
from workbench import train
from workbench.base.errors import NonFiniteError, RecipeError
from workbench.distributed.accelerator import host_transfer
from workbench.distributed.stopping import host_reads_every_step
from workbench.estimator.memory import estimate
from workbench.model.attention import FLEX_BLOCK, mask_bytes, resolve
from workbench.rundir.runs import RunDir
from workbench.training.parts import adamw_kernel, build_optimizer

from conftest import ROOT

LOOP = sys.modules["workbench.training.session"]  # the loop's module (workbench/training/session.py)


def tiny(*overrides: str) -> Recipe:
    return Recipe.load(ROOT / "recipes/tiny.yaml").override(*overrides)


def big(*overrides: str) -> Recipe:
    """Llama-3.1-8B QLoRA, 2 × 8192 packed tokens: where the mask matters."""
    return Recipe.load(ROOT / "recipes/llama3.1-8b-qlora.yaml").override("data.max_seq_len=8192",
                                                                          "training.micro_batch_size=2", *overrides)


def test_auto_takes_the_kernel_that_keeps_packed_samples_apart_without_a_dense_mask():
    cases = {  # (device, overrides) -> (kernel, how packed rows are kept apart)
        ("cpu", ()): ("sdpa", "per_sample"),
        ("cpu", ("training.fast_paths=false",)): ("sdpa", "dense_mask"),
        ("cuda", ()): ("flex_attention", "document_mask"),
        ("cuda", ("data.packing=false",)): ("sdpa", "none"),
        ("cuda", ("model.attn=sdpa",)): ("sdpa", "dense_mask"),
        ("cuda", ("model.attn=eager",)): ("eager", "dense_mask"),
    }
    for (device, overrides), expected in cases.items():
        chosen = resolve(tiny(*overrides), device)
        assert (chosen.implementation, chosen.packed_rows) == expected, (device, overrides)


def test_a_kernel_that_cannot_train_here_is_refused_naming_model_attn(monkeypatch, tmp_path):
    with pytest.raises(RecipeError, match="model.attn: flash_attention_2 runs on CUDA GPUs only"):
        resolve(tiny("model.attn=flash_attention_2"), "cpu")
    monkeypatch.setattr("workbench.model.attention.flash_attn_installed", lambda: False)
    with pytest.raises(RecipeError, match="model.attn: flash_attention_2 needs the flash-attn package"):
        resolve(tiny("model.attn=flash_attention_2"), "cuda")
    # an estimate for another machine does not ask this one's packages
    assert resolve(tiny("model.attn=flash_attention_2"), "cuda", here=False).packed_rows == "varlen"
    with pytest.raises(RecipeError, match="model.attn: flex_attention has no backward on a CPU"):
        train(tiny("model.attn=flex_attention", f"output.dir={tmp_path}/{{name}}"), progress_bar=False)
    assert not (tmp_path / "tiny").exists()  # refused before the run directory was touched


def test_the_estimate_charges_each_kernel_its_mask():
    """On a GPU with packed rows: sdpa's dense bool mask plus its bf16 bias, FlexAttention's block mask, nothing
    for flash's variable-length kernel; the planner's longest sequence follows."""
    acts = {attn: estimate(big(f"model.attn={attn}", "training.gradient_checkpointing=false"),
                           device="rtx4090").details["activations"] for attn in ("auto", "sdpa", "flash_attention_2")}
    rows, length, layers = 2, 8192, 32
    # a bool mask, and a bf16 bias kept by every layer for backward: 8.1 GiB
    assert acts["sdpa"] - acts["flash_attention_2"] == rows * length * length * (1 + 2 * layers)
    blocks = -(-length // FLEX_BLOCK)
    assert acts["auto"] - acts["flash_attention_2"] == rows * 16 * blocks * blocks  # 128 KiB
    checkpointed = {attn: estimate(big(f"model.attn={attn}", "training.gradient_checkpointing=true"),
                                   device="rtx4090").details["activations"] for attn in ("sdpa", "flash_attention_2")}
    assert checkpointed["sdpa"] - checkpointed["flash_attention_2"] == rows * length * length * (1 + 2)  # one layer
    longest = {attn: estimate(big(f"model.attn={attn}"), device="rtx4090").strategies[0]["limits"]["max_seq_len"]
               for attn in ("auto", "sdpa")}
    assert longest["auto"] > longest["sdpa"] > 0
    note = " ".join(estimate(big("model.attn=sdpa"), device="rtx4090").notes)
    assert "dense (row × row) mask" in note
    # on a CPU the loop's per-sample attention needs no mask; without the fast paths the bool mask is charged
    cpu = resolve(tiny("training.fast_paths=false"), "cpu")
    assert mask_bytes(cpu, 4, 128, 4, layers_kept=2) == 4 * 128 * 128 * (1 + 4 * 2)
    assert mask_bytes(resolve(tiny(), "cpu"), 4, 128, 4, layers_kept=2) == 0


def test_a_gpu_run_reads_the_device_only_where_it_must_decide(monkeypatch, tiny_recipe):
    """Off a CPU the NaN check is read at steps that log, evaluate, checkpoint or end (a host read waits for
    the device's queue): a NaN at step 2 is found at step 3's checkpoint, before that checkpoint is written."""
    assert host_reads_every_step("cpu", "stop") and host_reads_every_step("cuda", "skip")
    assert not host_reads_every_step("cuda", "stop")
    monkeypatch.setattr(LOOP, "host_reads_every_step", lambda device, on_nonfinite: False)
    recipe = tiny_recipe.override("training.lr=1e30", "training.max_steps=8", "output.save_every=3",
                                  "output.log_every=4")
    with pytest.raises(NonFiniteError, match=r"training.step 2: the loss or gradients are not finite "
                                             r"\(found at step 3's check\); no checkpoint was saved before it"):
        train(recipe, progress_bar=False)
    run = RunDir(recipe.run_dir)
    assert run.complete_checkpoints() == [] and run.read_json()["summary"]["status"] == "failed"


def test_gpu_batches_copy_without_waiting_and_adamw_is_one_fused_kernel(tiny_recipe):
    assert host_transfer("cuda") == {"pin_memory": True, "non_blocking": True}
    assert host_transfer("cpu") == {"pin_memory": False, "non_blocking": False}
    assert adamw_kernel("cuda") == {"fused": True} and adamw_kernel("cpu") == {"foreach": True}
    optimizer = build_optimizer(torch.nn.Linear(2, 2), tiny_recipe, "cpu")
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


@pytest.mark.slow
def test_compiled_layers_train_the_same_run(tiny_recipe, monkeypatch):
    """training.compile compiles each decoder layer in place: the same losses, and the run records what ran."""
    compiled = []
    import workbench.model.fastpath as fastpath

    real = fastpath.compile_layers
    monkeypatch.setattr(LOOP, "compile_layers", lambda model: compiled.append(real(model)) or compiled[-1])
    plain = train(tiny_recipe.override("name=plain", "training.max_steps=3"), progress_bar=False)
    fast = train(tiny_recipe.override("name=compiled", "training.max_steps=3", "training.compile=true"),
                 progress_bar=False)
    assert compiled == [2]  # builtin:tiny's two decoder layers
    assert fast.metrics["loss"].dropna().tolist() == pytest.approx(plain.metrics["loss"].dropna().tolist(), rel=1e-5)
    assert (fast.summary["attention"], fast.summary["attention_packed_rows"]) == ("sdpa", "per_sample")


def test_a_stop_signal_never_checkpoints_an_unchecked_nan(monkeypatch, tiny_recipe):
    """Deferred checks and a SIGTERM that arrives after a NaN step: the checkpoint the signal asks for is written
    only after the NaN check is read, so the run fails naming the step instead of saving NaN weights."""
    monkeypatch.setattr(LOOP, "host_reads_every_step", lambda device, on_nonfinite: False)
    real, sent = LOOP.lm_loss_sum, []

    def loss_then_signal(model, batch):
        out = real(model, batch)
        if model.training and not sent and not torch.isfinite(out):
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the loop's handler, honoured after this step
        return out

    monkeypatch.setattr(LOOP, "lm_loss_sum", loss_then_signal)
    recipe = tiny_recipe.override("training.lr=1e30", "training.max_steps=8", "output.save_every=5",
                                  "output.log_every=5")
    with pytest.raises(NonFiniteError, match=r"training.step 2: the loss or gradients are not finite"):
        train(recipe, progress_bar=False)
    assert sent and RunDir(recipe.run_dir).complete_checkpoints() == []


def _agree_on_two_ranks(rank: int, port: int, results) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from workbench.distributed.stopping import NonFiniteWatch, StopRequest, agree, host_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        accelerator = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
        watch = NonFiniteWatch("cpu")
        for step in range(1, 6):  # rank 1 sees a NaN at step 2, rank 0 at step 4
            loss = torch.tensor(float("nan") if (rank, step) in {(0, 4), (1, 2)} else 1.0)
            watch.observe(step, loss, torch.tensor(1.0))
        stop = StopRequest()
        stop.signum = signal.SIGTERM if rank == 1 else None  # only rank 1 got the signal
        group = host_group(30)  # None over gloo (a GPU backend gets a gloo group beside it)
        results[rank] = (agree(accelerator, watch.first, stop), agree(accelerator, None, stop, group), group)
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_earliest_nan_and_on_a_signal_every_step():
    """Where the NaN check is deferred, the stop signal is still agreed at every step (over the host), and a
    deciding step agrees on the earliest non-finite step any rank saw."""
    import torch.multiprocessing as mp

    from test_distributed import free_port

    results = mp.Manager().dict()
    mp.spawn(_agree_on_two_ranks, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        assert results[rank] == ((2, signal.SIGTERM), (0, signal.SIGTERM), None), results[rank]


def test_auto_leaves_flex_attention_to_models_and_gpus_that_run_it():
    from transformers import GPT2Config, LlamaConfig

    from workbench.model.attention import flex_unavailable, with_implementation

    assert "GPT2 has no FlexAttention" in flex_unavailable(GPT2Config(), torch.float32)
    assert flex_unavailable(LlamaConfig(), torch.float32) is None  # a CPU: no GPU backward to probe
    _, chosen = with_implementation(tiny(), "cuda", flex_problem="GPT2 has no FlexAttention in transformers")
    assert (chosen.implementation, chosen.packed_rows) == ("sdpa", "dense_mask")
    assert chosen.reason == "auto: GPT2 has no FlexAttention in transformers; sdpa"

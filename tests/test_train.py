import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from workbench import generate, load_run, train
from workbench.frontends.cli import main
from workbench.rundir.runs import RunDir


def adapter_weights(run_dir):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), key


def test_tiny_run_learns_and_writes_its_run_directory(tiny_recipe):
    result = train(tiny_recipe.override("output.eval_every=10", "output.save_every=10"), progress_bar=False)
    s = result.summary
    run_dir = result.run_dir
    assert s["status"] == "completed" and s["steps"] == s["total_steps"] == 20
    assert s["eval_loss_final"] < s["eval_loss_first"] - 0.5
    losses = result.metrics["loss"].dropna().tolist()
    assert losses[-1] < losses[0] - 0.5
    for key in ("tokens", "wall_s", "tokens_per_s", "peak_memory_mb", "mfu", "world_size", "strategy",
                "final_loss", "eval_loss_first", "eval_loss_final", "peak_memory_mb_per_rank"):
        assert s[key] is not None, key
    assert 0 < s["mfu"] < 1 and s["tokens_per_s"] > 0 and s["world_size"] == 1 and s["strategy"] == "single"
    # what was resident before the first step (the floor a short job pays in full) is part of the peak
    assert 0 < s["startup_peak_memory_mb"] <= s["peak_memory_mb"] and s["startup_s"] < s["wall_s"]
    # tokens counted are the real (unpadded) tokens of every step
    assert s["tokens"] == result.metrics["tokens"].dropna().iloc[-1] and s["tokens"] >= s["train_tokens"] * 2 * 0.9
    on_disk = json.loads((run_dir / "run.json").read_text())
    assert on_disk["summary"]["status"] == "completed" and "torch" in on_disk["env"]["versions"]
    eval_rows = result.metrics.dropna(subset=["eval_loss"]).to_dict("records")
    assert [r["step"] for r in eval_rows] == [0, 10, 20]
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_memory_mb"} <= set(result.metrics.columns)
    assert (run_dir / "recipe.yaml").exists() and (run_dir / "adapter" / "adapter_config.json").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-10", "step-20"]
    assert load_run(run_dir).summary == s


def test_adapter_reloads_with_plain_peft_and_matches_the_trained_weights(tiny_recipe):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from workbench.model.loading import attach_adapter, load_base_model

    result = train(tiny_recipe.override("training.max_steps=4", "output.save_every=4"), progress_bar=False)
    config = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, result.run_dir / "adapter").eval()

    # the training-time model, rebuilt from the last checkpoint's trainable weights
    trained = attach_adapter(load_base_model(tiny_recipe), tiny_recipe)
    missing, unexpected = trained.load_state_dict(
        load_file(str(result.run_dir / "checkpoints" / "step-4" / "model.safetensors")), strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    trained.eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        expected, got = trained(input_ids=ids).logits, plain(input_ids=ids).logits
        untouched = base.get_base_model()(input_ids=ids).logits if hasattr(base, "get_base_model") else None
    assert torch.allclose(expected, got, atol=1e-5)
    with plain.disable_adapter(), torch.no_grad():
        assert not torch.allclose(plain(input_ids=ids).logits, got, atol=1e-3)  # the adapter does something
    del untouched


def test_gradient_accumulation_matches_one_big_batch(tiny_recipe):
    common = ["training.max_steps=3", "training.scheduler=constant", "training.warmup_ratio=0"]
    big = train(tiny_recipe.override(*common, "name=big", "training.micro_batch_size=8", "training.grad_accum=1"),
                progress_bar=False)
    accumulated = train(tiny_recipe.override(*common, "name=acc", "training.micro_batch_size=2",
                                             "training.grad_accum=4"), progress_bar=False)
    big_rows = big.metrics.dropna(subset=["loss"]).to_dict("records")
    acc_rows = accumulated.metrics.dropna(subset=["loss"]).to_dict("records")
    for a, b in zip(big_rows, acc_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"]
    assert_same_weights(adapter_weights(big.run_dir), adapter_weights(accumulated.run_dir), atol=1e-4)


def test_resume_ends_with_the_same_adapter_as_an_uninterrupted_run(tiny_recipe):
    recipe = tiny_recipe.override("training.max_steps=6", "output.save_every=3", "output.keep_last=3",
                                  "adapter.dropout=0.1")  # dropout: the RNG state must be restored too
    whole = train(recipe, progress_bar=False)
    # Simulate a crash right after the step-3 checkpoint: copy the run, drop what came later.
    crashed = recipe.override(f"output.dir={whole.run_dir.parent}/crashed")
    shutil.copytree(whole.run_dir, crashed.run_dir)
    shutil.rmtree(crashed.run_dir / "checkpoints" / "step-6")
    shutil.rmtree(crashed.run_dir / "adapter")
    RunDir(crashed.run_dir).update_json(summary={"status": "running"})  # as a killed run leaves it
    resumed = train(crashed, resume=True, progress_bar=False)
    assert resumed.summary["steps"] == 6
    assert_same_weights(adapter_weights(whole.run_dir), adapter_weights(resumed.run_dir))
    whole_losses = whole.metrics["loss"].dropna().tolist()
    resumed_losses = resumed.metrics["loss"].dropna().tolist()
    assert resumed_losses == whole_losses  # metrics.jsonl continues without duplicated steps


def test_existing_run_is_refused_without_resume_or_overwrite(tiny_recipe, capsys):
    recipe = tiny_recipe.override("training.max_steps=1")
    train(recipe, progress_bar=False)
    path = recipe.run_dir.parent / "r.yaml"
    recipe.save(path)
    assert main(["train", str(path), "--no-progress"]) == 1
    assert "already holds a run: pass --resume" in capsys.readouterr().err
    assert main(["train", str(path), "--no-progress", "--overwrite"]) == 0


def test_bad_data_row_fails_the_cli_cleanly(tiny_recipe, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    '{"messages": [{"role": "user"}]}\n')
    path = tmp_path / "r.yaml"
    tiny_recipe.override(f"data.train={data}", "data.eval=null").save(path)
    assert main(["train", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {data}:2: messages[0]: missing field 'content'"


def test_tensorboard_tracker_and_cli_tools(tiny_recipe, capsys):
    result = train(tiny_recipe.override("training.max_steps=2", "output.trackers=[tensorboard]"), progress_bar=False)
    assert list(result.run_dir.rglob("events.out.tfevents.*"))
    assert main(["runs", str(result.run_dir.parent)]) == 0
    assert "tiny" in capsys.readouterr().out
    args = ["generate", str(result.run_dir), "--prompt", "What is 2 plus 2?", "--max-new-tokens", "5"]
    assert main(args) == 0
    assert capsys.readouterr().out == generate(result.run_dir, "What is 2 plus 2?", max_new_tokens=5) + "\n"


def test_peak_memory_is_the_process_own_not_an_inherited_one():
    """ru_maxrss survives exec on Linux: a run started by a large process must not report that process's peak."""
    import subprocess
    import sys

    ballast = bytearray(768 * 2**20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touch every page so it is resident
    code = "from workbench.hardware.current import peak_rss_bytes; print(peak_rss_bytes())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(child.stdout) < 600 * 2**20, "the child reported its parent's peak"
    del ballast


def test_metrics_lines_that_are_not_rows_are_skipped(tmp_path):
    """A torn last line or a hand-edited value that is not an object never reaches code that reads rows."""
    from workbench.base.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n5\n[1, 2]\n"text"\nnull\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]

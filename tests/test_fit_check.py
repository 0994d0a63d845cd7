"""training.fit_check: one step on the longest micro-batch, before the run directory is written, against a memory
budget (on a CPU: the process's peak RSS against distributed.device_memory / --device-memory)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import Recipe, train

ROOT = Path(__file__).resolve().parents[1]
FP32 = ["model.dtype=float32", "training.mixed_precision=no"]  # the same bytes on either kind of CPU


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory) -> Path:
    """Rows long enough that a micro-batch of 16 packed 1,024-token rows costs hundreds of MB of activations."""
    rng = random.Random(0)
    words = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()
    path = tmp_path_factory.mktemp("long") / "long.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "say"},
        {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(700))}]}) + "\n"
        for _ in range(64)))
    return path


# The estimate read as if it allowed any micro-batch: what an estimate that is too optimistic starts the fit check at
OPTIMISTIC = ("import sys; import workbench.estimator.batch_choice as choice; "
              "choice.micro_batch_limit = lambda *a, **k: 4096; "
              "from workbench.frontends.cli import main; sys.exit(main(sys.argv[1:]))")


def cli_train(run_dir: Path, data: Path, *extra: str, entry: tuple[str, ...] = ("-m", "workbench")
              ) -> subprocess.CompletedProcess:
    """A fresh process: its peak RSS is the run's own."""
    return subprocess.run(
        [sys.executable, *entry, "train", "recipes/tiny.yaml", f"output.dir={run_dir}", f"data.train={data}",
         "data.eval=null", "data.max_seq_len=1024", "training.max_steps=1", "training.threads=1", *FP32,
         "--no-progress", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)


def first_loss(run_dir: Path) -> float:
    return next(r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r)


def test_a_step_that_does_not_fit_stops_before_the_run_directory_naming_what_keeps_the_batch(tmp_path, long_rows):
    """The check measures the longest micro-batch's step; over the budget it names the step's share, the
    estimate's largest terms and settings that keep micro-batch x accumulation and fit. With
    training.micro_batch_size auto, the same budget steps down from the split that did not fit to one that does,
    for real, and trains the same step."""
    big = ["training.micro_batch_size=16", "training.grad_accum=1"]
    measured = cli_train(tmp_path / "a", long_rows, *big, "--device-memory", "64GiB")
    assert measured.returncode == 0, measured.stderr
    check = json.loads((tmp_path / "a" / "run.json").read_text())["summary"]["fit_check"]
    peak, start = check["fit_check_peak_bytes"], check["fit_check_start_bytes"]
    assert check["fit_check"] == "fits" and peak > start + 100 * 2**20  # the step's activations are seen
    budget = start + int(0.6 * (peak - start))  # the process fits, its step does not

    refused = cli_train(tmp_path / "b", long_rows, *big, "--device-memory", str(budget))
    err = refused.stderr.strip()
    assert refused.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: training.fit_check: one step on the longest micro-batch of the data (16 x 1024 "
                          "tokens) peaked at "), err
    assert "the estimate's largest terms on single: " in err and "activations" in err
    assert not (tmp_path / "b").exists()  # nothing written
    splits = [s for s in err.split("; ") if s.startswith("training.micro_batch_size=")]
    assert splits, err
    assert all(int(split.split()[0].split("=")[1]) * int(split.split()[1].split("=")[1]) == 16 for split in splits)

    # an estimate that allows 16 starts the check there; 16 does not fit, a smaller split is measured and taken
    auto = ["training.micro_batch_size=auto", "training.grad_accum=1", "training.batch_size=16"]
    taken = cli_train(tmp_path / "c", long_rows, *auto, "--device-memory", str(budget), entry=("-c", OPTIMISTIC))
    assert taken.returncode == 0, taken.stderr
    assert "micro-batch 16 peaked at" in taken.stdout and "measuring a smaller split" in taken.stdout
    summary = json.loads((tmp_path / "c" / "run.json").read_text())["summary"]
    choice, check = summary["batch_choice"], summary["fit_check"]
    assert choice["micro_batch_size"] < 16 and choice["micro_batch_size"] * choice["grad_accum"] == 16
    assert "measured step fit" in choice["reason"] and check["micro_batch_size"] == choice["micro_batch_size"]
    assert check["fit_check"] == "fits" and check["fit_check_peak_bytes"] <= budget
    saved = Recipe.load(tmp_path / "c" / "recipe.yaml").training  # the split taken, as numbers a resume keeps
    assert (saved.micro_batch_size, saved.grad_accum, saved.batch_size) == (choice["micro_batch_size"],
                                                                            choice["grad_accum"], 16)
    assert first_loss(tmp_path / "c") == pytest.approx(first_loss(tmp_path / "a"), rel=1e-5)  # the same 16 rows


def test_a_budget_below_the_process_itself_is_one_line_and_writes_nothing(tmp_path, long_rows):
    refused = cli_train(tmp_path / "runs", long_rows, "--device-memory", "100MiB")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "over the 100 MiB of distributed.device_memory" in refused.stderr
    assert not (tmp_path / "runs").exists()


def test_a_checked_run_trains_exactly_as_an_unchecked_one(tmp_path):
    """The check's step updates nothing: lr 0, its gradients and optimizer states dropped, dropout's random state
    put back. Losses and adapter weights equal bit for bit (dropout on, so the random state matters)."""
    from safetensors.torch import load_file

    def run(name: str, *overrides: str):
        recipe = Recipe.load(ROOT / "recipes/tiny.yaml", [
            f"output.dir={tmp_path}/{name}", "training.max_steps=3", "adapter.dropout=0.1", "data.eval=null",
            "output.eval_every=null", "output.log_every=1", *FP32, *overrides])
        result = train(recipe, progress_bar=False)
        losses = [r["loss"] for r in map(json.loads, (result.run_dir / "metrics.jsonl").read_text().splitlines())
                  if "loss" in r]
        return result, losses, load_file(str(result.run_dir / "adapter" / "adapter_model.safetensors"))

    checked, checked_losses, checked_weights = run("checked", "training.fit_check=true",
                                                   "distributed.device_memory=64GiB")
    plain, plain_losses, plain_weights = run("plain", "training.fit_check=false")
    assert checked.summary["fit_check"]["fit_check"] == "fits" and plain.summary.get("fit_check") is None
    assert checked_losses == plain_losses
    assert all((checked_weights[k] == plain_weights[k]).all() for k in plain_weights)


def test_auto_checks_a_cpu_only_under_a_budget():
    import torch

    from workbench.training.fit_check import budget_for

    cpu = torch.device("cpu")
    tiny = Recipe.load(ROOT / "recipes/tiny.yaml")
    assert budget_for(tiny, cpu) is None
    assert budget_for(tiny.override("distributed.device_memory=2GiB"), cpu).bytes == 2 * 2**30
    assert budget_for(tiny.override("training.fit_check=false", "distributed.device_memory=2GiB"), cpu) is None
    assert budget_for(tiny.override("training.fit_check=true"), cpu).source == "this machine's RAM"


def test_a_step_whose_gradients_are_not_finite_leaves_the_weights_as_they_were():
    """AdamW at rate 0 adds 0 x its update, which is NaN where the gradients are: the check then takes no
    optimizer step at all (the run's own on_nonfinite decides what such a batch does)."""
    from types import SimpleNamespace

    import torch

    from workbench.training.fit_check import measure_step

    model = torch.nn.Linear(4, 1)
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, reduce=lambda t, reduction: t,
                                  backward=lambda loss: loss.backward(),
                                  gradient_state=SimpleNamespace(_set_sync_gradients=lambda value: None))
    for poison in (float("nan"), 1.0):
        objective = SimpleNamespace(counts=lambda m, b: torch.ones(1),
                                    loss=lambda m, b, t, p=poison: SimpleNamespace(loss=(m(b["x"]) * p).sum()))
        peak, start, out_of_memory = measure_step(accelerator, model, optimizer, objective, {"x": torch.ones(2, 4)})
        assert peak > 0 and not out_of_memory
        assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items()), poison
        assert not optimizer.state and all(p.grad is None for p in model.parameters())
        assert [g["lr"] for g in optimizer.param_groups] == [1e-3]

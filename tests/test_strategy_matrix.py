"""Every layout against one process, for real (gloo, builtin:tiny, float32): DDP, FSDP2 full and hybrid, ZeRO-1/2/3,
each with and without gradient accumulation, LoRA and 4-bit QLoRA, tensor parallel and pipeline parallel; resumed on another process
count and layout; `auto` choosing a sharded layout when no replica fits.

Two data-parallel processes with micro-batch b follow one process with micro-batch 2b: the same samples make each
step, and the loss is normalised over the step's target tokens on every rank. Two tensor-parallel processes read one
batch stream together: with micro-batch 2b, as one process; so do a pipeline's two stages. Judged from what the ranks recorded (run.json,
metrics.jsonl, the adapter), never from the launch flags. One launch per family of layouts trains all of its cells
in turn (tests/strategy_worker.py): importing the stack is most of a small run's time.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_distributed import (COMMON, RECIPE, TIMEOUT_S, adapter, assert_close_adapters, free_port, launch, losses,
                              summary_of)
from workbench import Recipe
from workbench.estimator.memory import estimate
from workbench.rundir.runs import RunDir

pytestmark = pytest.mark.slow

STEPS = 4
CELL = [f"training.max_steps={STEPS}", "output.save_every=2", *[c for c in COMMON if "max_steps" not in c]]
METHODS = {"lora": [], "qlora": ["adapter.method=qlora", "quantization.quant_storage=float32"]}
# preference objectives on LoRA: a pair is one row of two sequences, normalised over the step's pairs on every rank
PREFERENCE_DATA = ["data.train=recipes/data/preference_train.jsonl", "data.format=preference",
                   "data.eval=recipes/data/preference_eval.jsonl"]
OBJECTIVES = {"dpo": [*PREFERENCE_DATA, "training.objective=dpo"],
              "orpo": [*PREFERENCE_DATA, "training.objective=orpo"],
              # KTO: its KL estimate is summed over the step's micro-batches and ranks like the loss's counts
              "kto": ["data.train=recipes/data/unpaired_train.jsonl", "data.format=unpaired", "training.objective=kto",
                      "data.eval=recipes/data/unpaired_eval.jsonl"],
              # a reward model: a sequence classifier whose score head trains whole beside the adapter
              "reward": [*PREFERENCE_DATA, "training.objective=reward"]}
OBJECTIVE_CELLS = (("dpo", 2), ("orpo", 1), ("kto", 2), ("reward", 1))  # (objective, grad_accum)
# An objective's sums over micro-batches and ranks are the loop's, not the engine's: replicated, DeepSpeed's engine
# with its parameters sharded, and FSDP2 cover every way a layout runs its backward (ZeRO-1/2 run ZeRO-3's engine).
OBJECTIVE_LAYOUTS = ("ddp", "zero3", "fsdp")


def method_cells(layout: str) -> list[tuple[str, int]]:
    """(method, grad_accum) on a layout: LoRA and QLoRA with and without accumulation; ZeRO-1 runs LoRA alone (its
    4-bit weights take ZeRO-2's path: the stages differ in how gradients are partitioned, not in the weights);
    tensor parallel runs LoRA (it refuses 4-bit weights), its accumulation in tests/test_tensor_parallel.py; pipeline
    parallel runs LoRA with the step's two micro-batches flowing through its two stages (1F1B needs a micro-batch a
    stage at least)."""
    if layout == "tp":
        return [("lora", 1)]
    if layout == "pp":
        return [("lora", 2)]
    return [(m, ga) for m in METHODS for ga in (1, 2) if not (layout == "zero1" and m == "qlora")]
LAYOUTS = {
    "ddp": ["distributed.strategy=ddp"],
    "zero1": ["distributed.strategy=deepspeed", "distributed.deepspeed.stage=1"],
    "zero2": ["distributed.strategy=deepspeed", "distributed.deepspeed.stage=2"],
    "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.stage=3"],
    "fsdp": ["distributed.strategy=fsdp"],
    # its per-sample attention and chunked head read whole weights: off (strategies._tensor_parallel_problem)
    "tp": ["distributed.strategy=tp", "training.fast_paths=false"],
    # the fast paths on: the per-sample attention on every stage, the chunked head in the last stage's loss
    "pp": ["distributed.strategy=pp"],
}
FAMILIES = {"ddp": ["ddp"], "deepspeed": ["zero1", "zero2", "zero3"], "fsdp": ["fsdp"], "tp": ["tp"], "pp": ["pp"]}
GLOBAL_BATCH = 4  # samples per step in every cell
# an epoch that ends on a short step: 9 rows make steps of 4, 4 and 1 samples, then step 4 starts the next epoch (with
# one process a micro-batch over, the others run a stand-in that adds nothing)
EPOCH_END = ["data.packing=false", "data.limit=9"]
EPOCH_END_CELLS = [(layout, 2) for layout in LAYOUTS] + [("fsdp", 1)]
LOSS_RTOL, ADAPTER_ATOL = 1e-4, 2e-5  # float32 reductions in another order; measured differences are ~1e-7
# On a CPU with AVX-512 BF16, bitsandbytes registers other 4-bit CPU kernels (its backends/cpu/ops.py) whose float32
# sums depend on the micro-batch's shape: QLoRA adapters then differ by up to 2.3e-5 between layouts (measured at
# ddp/zero1/zero2 with accumulation 2); elsewhere ~1e-7, like the other methods.
# A reward model on an Intel Xeon with AVX-512 BF16: its adapter after one process's 1 x 4 micro-batches and after
# its 2 x 2 differ by 4.0e-5 (and 2 processes of 2 equal the 2 x 2 exactly, 0.0): float32 sums of that CPU's
# kernels depend on the micro-batch's shape, and AdamW's first steps turn a difference in a near-zero gradient into
# a full-size update. Measured 4.0e-5 at ddp, zero3 and fsdp alike; on an AMD EPYC within 2e-5.
SHAPE_SENSITIVE = ("qlora", "reward")
SHAPE_SENSITIVE_ADAPTER_ATOL = 5e-5


def adapter_atol(method: str) -> float:
    return SHAPE_SENSITIVE_ADAPTER_ATOL if method in SHAPE_SENSITIVE else ADAPTER_ATOL


def batch(grad_accum: int, world: int, layout: str = "ddp") -> list[str]:
    # a tensor-parallel group, and a pipeline's stages, read one batch stream (Layout.batch_streams)
    streams = 1 if layout in ("tp", "pp") else world
    return [f"training.grad_accum={grad_accum}", f"training.micro_batch_size={GLOBAL_BATCH // grad_accum // streams}"]


def run_worker(cells: dict, nproc: int, tmp, nnodes: int = 1, name: str = "cells") -> dict:
    """Train the cells in one launch (nnodes simulated machines of nproc processes); returns refusals by run dir."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cells))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NUM_NODES": str(nnodes)}
    worker = [os.path.join(os.path.dirname(__file__), "strategy_worker.py"), str(path)]
    if nproc * nnodes == 1:
        commands = [[sys.executable, *worker]]
    else:
        port = str(free_port())
        commands = [[sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                     str(nproc * nnodes), "--num_machines", str(nnodes), "--machine_rank", str(rank),
                     "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no",
                     "--dynamo_backend", "no", *(["--rdzv_backend", "static", "--same_network"] if nnodes > 1 else []),
                     *worker] for rank in range(nnodes)]
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  start_new_session=True) for c in commands]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for p in processes:
                os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"the {name} launch timed out:\n{process.communicate()[0][-4000:]}") from None
    out = outputs[0]
    errors_file = path.with_name(path.name + ".errors-0")
    assert errors_file.exists(), f"the {name} launch did not finish its cells:\n{out[-4000:]}"
    return json.loads(errors_file.read_text())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every cell once: one process as the reference, then one launch per family."""
    root = tmp_path_factory.mktemp("matrix")
    refs = {str(root / f"single-{m}-ga{ga}"): {"overrides": [*CELL, *METHODS[m], *batch(ga, 1)]}
            for m in METHODS for ga in (1, 2)}
    refs.update({str(root / f"single-{o}-ga{ga}"): {"overrides": [*CELL, *OBJECTIVES[o], *batch(ga, 1)]}
                 for o, ga in OBJECTIVE_CELLS})
    refs.update({str(root / f"single-epoch_end-ga{ga}"): {"overrides": [*CELL, *EPOCH_END, *batch(ga, 1)]}
                 for ga in (1, 2)})
    launches = [dict(cells=refs, nproc=1, name="single")]
    for family, layouts in FAMILIES.items():
        cells = {str(root / f"{layout}-{m}-ga{ga}"): {"overrides": [*CELL, *LAYOUTS[layout], *METHODS[m],
                                                                     *batch(ga, 2, layout)]}
                 for layout in layouts for m, ga in method_cells(layout)}
        cells.update({str(root / f"{layout}-{o}-ga{ga}"): {"overrides": [*CELL, *LAYOUTS[layout], *OBJECTIVES[o],
                                                                         *batch(ga, 2)]}
                      for layout in layouts if layout in OBJECTIVE_LAYOUTS for o, ga in OBJECTIVE_CELLS})
        cells.update({str(root / f"{layout}-epoch_end-ga{ga}"): {"overrides": [*CELL, *LAYOUTS[layout], *EPOCH_END,
                                                                             *batch(ga, 2, layout)]}
                      for layout, ga in EPOCH_END_CELLS if layout in layouts})
        if family == "fsdp":  # auto, where no replica fits the memory it is given, must run a sharded layout
            cells[str(root / "auto")] = {"overrides": [*CELL, *batch(1, 2), *AUTO_CELL, "distributed.strategy=auto",
                                                       f"distributed.device_memory={memory_for_fsdp_only()}"]}
        launches.append(dict(cells=cells, nproc=2, name=family))
    hybrid = {str(root / f"fsdp_hybrid-lora-ga{ga}"): {"overrides": [*CELL, *LAYOUTS["fsdp"], *batch(ga, 4),
                                                                     "distributed.fsdp.sharding=hybrid"]}
              for ga in (1,)}
    launches.append(dict(cells=hybrid, nproc=2, nnodes=2, name="hybrid"))
    refused = run_workers(launches, root)
    assert not {cell: error for cell, error in refused.items() if "/single-" in cell}  # the references all trained
    return root, refused


def run_workers(launches: list[dict], tmp) -> dict:
    """The launches, two at a time, longest first (they are independent: each trains its own cells): a launch's
    processes spend much of their time waiting on each other, so a second launch uses the cores they leave idle.
    Every process keeps one thread (OMP_NUM_THREADS=1), so its numbers are the same run alone or beside another.
    A launch's length: its processes times its cells, its start-up counted as about five cells."""
    def length(launch: dict) -> int:
        return launch["nproc"] * launch.get("nnodes", 1) * (len(launch["cells"]) + 5)

    order = sorted(launches, key=length, reverse=True)
    refused = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for errors in pool.map(lambda launch: run_worker(tmp=tmp, **launch), order):
            refused.update(errors)
    return refused


# full fine-tuning: its sharded states outweigh what FSDP2 holds whole (the root: embeddings and head, which are
# most of the tiny model's weights, and two layers)
AUTO_CELL = ["adapter.method=full"]


def memory_for_fsdp_only() -> int:
    """A machine memory in which two FSDP processes fit and two ZeRO-2 (or DDP) processes do not."""
    rows = {s["name"]: s["cpu_bytes"] for s in estimate(Recipe.load(RECIPE, [*CELL, *batch(1, 2), *AUTO_CELL]),
                                                        world_size=2, device="cpu").strategies}
    assert rows["fsdp"] < min(rows["zero2"], rows["zero1"], rows["ddp"])
    return (rows["fsdp"] + min(rows["zero2"], rows["zero1"], rows["ddp"])) // 2


CELLS = [(layout, m, ga) for layout in LAYOUTS for m, ga in method_cells(layout)]
CELLS += [(layout, o, ga) for layout in OBJECTIVE_LAYOUTS for o, ga in OBJECTIVE_CELLS]


@pytest.mark.parametrize("layout, method, grad_accum", CELLS, ids=[f"{l}-{m}-ga{g}" for l, m, g in CELLS])
def test_two_processes_follow_one_with_the_double_batch(matrix, layout, method, grad_accum):
    root, refused = matrix
    cell, reference = root / f"{layout}-{method}-ga{grad_accum}", root / f"single-{method}-ga{grad_accum}"
    assert str(cell) not in refused, refused.get(str(cell))
    s = summary_of(cell)
    assert (s["world_size"], s["layout"]["name"]) == (2, layout)
    assert s["distributed_type"] == {"ddp": "MULTI_CPU", "fsdp": "FSDP", "tp": "MULTI_GPU",
                                     "pp": "MULTI_CPU"}.get(layout, "DEEPSPEED")
    if layout in ("fsdp", "zero3"):
        assert max(s["param_elements_per_rank"]) < 0.55 * s["params"]  # the weights really are split
    elif layout == "tp":  # slices of every decoder layer; the embeddings and head (most of the tiny model) whole
        assert max(s["param_elements_per_rank"]) < s["params"]
    elif layout == "pp":  # a stage each: a decoder layer, and the embeddings on the first, the norm and head on the last
        assert sum(s["param_elements_per_rank"]) == s["params"] and max(s["param_elements_per_rank"]) < 0.55 * s["params"]
    else:
        a, b = s["trainable_checksum_per_rank"]
        assert a == b  # replicas hold identical adapters
    assert len(losses(cell)) == STEPS
    assert losses(cell) == pytest.approx(losses(reference), rel=LOSS_RTOL)
    assert_close_adapters(adapter(cell), adapter(reference), atol=adapter_atol(method))
    if method in OBJECTIVES:  # the preference figures too: margins and accuracy over the same pairs
        assert s["objective"] == method
        assert column(cell, "reward_margin") == pytest.approx(column(reference, "reward_margin"), rel=1e-3, abs=1e-6)
        assert column(cell, "reward_accuracy") == column(reference, "reward_accuracy")
        if method == "kto":
            assert column(cell, "kl") == pytest.approx(column(reference, "kl"), rel=1e-3, abs=1e-6)
        # the held-out pairs (rows), each scored once on one process, stand-ins where a process has none left
        for name in ("eval_loss", "eval_reward_margin", "eval_reward_accuracy"):
            assert column(cell, name, "eval_loss") == pytest.approx(column(reference, name, "eval_loss"),
                                                                    rel=1e-4, abs=1e-6), name
        assert len(column(cell, "eval_loss", "eval_loss")) == 2  # before the first step and after the last


def column(run_dir, name: str, row: str = "loss") -> list:
    """`name` in each row of metrics.jsonl that has `row` (training rows, or evaluation rows)."""
    return [r[name] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if row in r]


@pytest.mark.parametrize("layout, grad_accum", EPOCH_END_CELLS, ids=[f"{l}-ga{g}" for l, g in EPOCH_END_CELLS])
def test_the_short_step_that_ends_an_epoch_holds_the_same_samples_on_every_layout(matrix, layout, grad_accum):
    """The epoch's last step holds its last sample on one process and nothing on the other: the same samples (the
    same tokens, counted exactly) and the same update as one process, and the next epoch starts in step."""
    root, refused = matrix
    cell, reference = root / f"{layout}-epoch_end-ga{grad_accum}", root / f"single-epoch_end-ga{grad_accum}"
    assert str(cell) not in refused, refused.get(str(cell))
    assert (summary_of(cell)["world_size"], summary_of(reference)["train_examples"]) == (2, 9)
    assert column(reference, "epoch") == [0, 0, 0, 1]
    assert column(cell, "tokens") == column(reference, "tokens")
    steps = [b - a for a, b in zip([0, *column(reference, "tokens")], column(reference, "tokens"))]
    assert steps[2] < min(steps[0], steps[1], steps[3])  # the short step: one sample of four
    assert losses(cell) == pytest.approx(losses(reference), rel=LOSS_RTOL)
    assert_close_adapters(adapter(cell), adapter(reference), atol=ADAPTER_ATOL)


def test_accumulation_changes_nothing_but_the_micro_batch(matrix):
    """The same samples per step, in two micro-batches instead of one: the same run."""
    root, _ = matrix
    for method in [*METHODS, "epoch_end"]:
        assert losses(root / f"single-{method}-ga2") == pytest.approx(losses(root / f"single-{method}-ga1"),
                                                                     rel=LOSS_RTOL)


def test_hybrid_shard_follows_one_process(matrix):
    """Two machines of two processes: each machine holds one copy, in halves."""
    root, refused = matrix
    cell = root / "fsdp_hybrid-lora-ga1"
    assert str(cell) not in refused, refused.get(str(cell))
    s = summary_of(cell)
    assert (s["world_size"], s["layout"]["name"]) == (4, "fsdp_hybrid")
    assert s["param_elements_per_rank"] == [s["params"] // 2] * 4
    c0, c1, c2, c3 = s["trainable_checksum_per_rank"]
    assert c0 == c2 and c1 == c3 and c0 != c1  # the same shard on both machines, different shards on one
    assert losses(cell) == pytest.approx(losses(root / "single-lora-ga1"), rel=LOSS_RTOL)


def test_auto_runs_a_sharded_layout_where_no_replica_fits(matrix):
    root, refused = matrix
    s = summary_of(root / "auto")
    assert s["layout"]["name"] == "fsdp" and s["strategy_reason"].startswith("auto: fsdp is the first layout")
    assert s["distributed_type"] == "FSDP" and max(s["param_elements_per_rank"]) < 0.55 * s["params"]
    saved = Recipe.load(root / "auto" / "recipe.yaml")
    assert saved.distributed.strategy == "auto"  # a resume on another process count chooses again


def test_sharded_adapters_load_in_one_process(matrix, tiny_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _ = matrix
    for cell in ("fsdp-lora-ga1", "zero3-lora-ga2", "pp-lora-ga2"):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), root / cell / "adapter")
        loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        assert len(loaded) == len(adapter(root / cell)) > 0
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            tuned = model(ids).logits
            with model.disable_adapter():
                base = model(ids).logits
        assert not torch.allclose(tuned, base)  # the adapter is really applied


# -- resumed on another process count or layout -----------------------------------------------------------------


def interrupted_copy(source, target):
    """The run as a kill after its step-2 checkpoint leaves it."""
    shutil.copytree(source, target)
    run = RunDir(target)
    shutil.rmtree(run.checkpoint(STEPS))
    shutil.rmtree(target / "adapter")
    run.update_json(summary={"status": "running"})
    return target


RESUMES = [  # copy of, resumed on (layout, processes)
    ("fsdp-lora-ga1", "single", 1), ("zero3-lora-ga1", "single", 1), ("zero2-qlora-ga2", "single", 1),
    ("single-lora-ga1", "fsdp", 2), ("single-qlora-ga2", "ddp", 2), ("fsdp-qlora-ga1", "fsdp", 2),
    ("zero3-lora-ga2", "zero3", 2), ("single-dpo-ga2", "ddp", 2), ("zero3-orpo-ga1", "zero3", 2),
    # tensor parallel's checkpoints hold the portable copy alone: within the layout, out of it and into it
    ("tp-lora-ga1", "tp", 2), ("tp-lora-ga1", "single", 1), ("single-lora-ga2", "tp", 2),
    # so do a pipeline's: gathered from its stages, each stage loading its own parameters' tensors
    ("pp-lora-ga2", "pp", 2), ("pp-lora-ga2", "single", 1), ("single-lora-ga2", "pp", 2),
]


@pytest.fixture(scope="module")
def resumed(matrix):
    root, _ = matrix
    groups: dict = {}
    for source, layout, world in RESUMES:
        method, ga = source.split("-")[1], int(source[-1])
        target = interrupted_copy(root / source, root / f"{source}-on-{layout}")
        overrides = [*CELL, *{**METHODS, **OBJECTIVES}[method], *batch(ga, world, layout),
                     *LAYOUTS.get(layout, ["distributed.strategy=auto"])]
        groups.setdefault((layout.rstrip("0123"), world), {})[str(target)] = {"overrides": overrides, "resume": True}
    # a ZeRO engine loads only its own partitions: a one-process checkpoint resumed under ZeRO-2 is refused
    refused_target = interrupted_copy(root / "single-lora-ga2", root / "single-lora-ga2-on-zero2")
    groups[("zero", 2)][str(refused_target)] = {"overrides": [*CELL, *batch(2, 2), *LAYOUTS["zero2"]], "resume": True}
    # the 2-process run's own micro-batch and accumulation on one process: the accumulation doubles to keep 4 samples
    as_it_was = interrupted_copy(root / "ddp-lora-ga1", root / "ddp-lora-ga1-as-it-was-on-single")
    groups[("single", 1)][str(as_it_was)] = {"overrides": [*CELL, *batch(1, 2)], "resume": True}
    return root, run_workers([dict(cells=cells, nproc=world, name=f"resume-{family}-{world}")
                              for (family, world), cells in groups.items()], root)


@pytest.mark.parametrize("source, layout, world", RESUMES, ids=[f"{s}-on-{l}" for s, l, _ in RESUMES])
def test_a_checkpoint_resumes_on_another_process_count_or_layout(resumed, source, layout, world):
    root, refused = resumed
    target = root / f"{source}-on-{layout}"
    assert str(target) not in refused, refused.get(str(target))
    s = summary_of(target)
    assert (s["steps"], s["world_size"], s["layout"]["name"]) == (STEPS, world, layout)
    uninterrupted = root / source
    assert losses(target) == pytest.approx(losses(uninterrupted), rel=LOSS_RTOL)
    assert_close_adapters(adapter(target), adapter(uninterrupted), atol=ADAPTER_ATOL)


def test_a_run_resumed_on_fewer_processes_keeps_its_samples_per_step(resumed):
    root, refused = resumed
    target, uninterrupted = root / "ddp-lora-ga1-as-it-was-on-single", root / "ddp-lora-ga1"
    assert str(target) not in refused, refused.get(str(target))
    s = summary_of(target)
    assert (s["steps"], s["world_size"]) == (STEPS, 1)
    assert s["resume_changes"][-1]["changes"]["training.grad_accum"] == [1, 2]
    assert column(target, "tokens") == column(uninterrupted, "tokens")
    assert losses(target) == pytest.approx(losses(uninterrupted), rel=LOSS_RTOL)


def test_a_pair_that_cannot_resume_is_refused_naming_both_layouts(resumed):
    root, refused = resumed
    message = refused.get(str(root / "single-lora-ga2-on-zero2"), "")
    assert ("written by single on 1 process(es) with micro-batch 2 and this run is zero2 on 2 process(es) with "
            "micro-batch 1") in message, refused
    assert "a DeepSpeed engine loads only its own ZeRO partitions" in message


# -- a stalled or dead peer names itself --------------------------------------------------------------------------


def test_a_killed_rank_stops_the_run_naming_it_and_the_checkpoint_resumes(tmp_path):
    """Rank 1 is killed while the step-6 checkpoint is being written: rank 0 stops within seconds with an error
    naming rank 1 and the step, step-6 never appears, and step-3 resumes to the end."""
    run_dir = tmp_path / "killed"
    overrides = [*COMMON, "training.max_steps=8", "output.save_every=3", "distributed.strategy=ddp",
                 "training.micro_batch_size=1", "distributed.timeout_s=30"]
    command = [sys.executable, "-m", "workbench", "launch", RECIPE, "--nproc", "2", "--master",
               f"127.0.0.1:{free_port()}", f"output.dir={run_dir}", *overrides, "--overwrite"]
    # both ranks hold step 6's write open for 5 s: time enough to find and kill rank 1 inside it (a poll of 0.1 s),
    # and all of it waited out by rank 0 before it reaches the collective that fails
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORA_WORKBENCH_CHECKPOINT_PAUSE": "6:5"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not RunDir(run_dir).staging_checkpoint(6).exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
            time.sleep(0.1)
        victim = rank_pid(run_dir, 1)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = process.communicate(timeout=120)
        stopped_after = time.monotonic() - killed
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0 and stopped_after < 45, (stopped_after, out[-3000:])
    s = RunDir(run_dir).read_json()["summary"]
    assert s["status"] == "failed" and f"rank 1 (pid {victim}) exited" in s["error"], s.get("error")
    assert "a collective after step 6" in s["error"] and "--resume" in s["error"]
    assert [step for step, _ in RunDir(run_dir).complete_checkpoints()] == [3]
    again = launch(run_dir, *overrides[len(COMMON):], resume=True)
    assert again["steps"] == 8 and again["status"] == "completed"


def rank_pid(run_dir, rank: int) -> int:
    """The pid of the training process of `rank` in the launch writing run_dir."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"train" in cmdline and f"output.dir={run_dir}".encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no process of rank {rank} found")


def test_a_machine_that_never_joins_stops_the_launch_in_bounded_time(tmp_path):
    """--nnodes 2 and no second machine: the launch says so within startup_timeout_s, not after 10 minutes."""
    command = [sys.executable, "-m", "workbench", "launch", RECIPE, "--nproc", "1", "--nnodes", "2", "--node-rank",
               "0", "--master", f"127.0.0.1:{free_port()}", f"output.dir={tmp_path / 'alone'}", *COMMON,
               "distributed.strategy=ddp", "distributed.startup_timeout_s=3", "--overwrite"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and time.monotonic() - started < 60
    assert "did not find each other within distributed.startup_timeout_s=3 s at --master" in done.stderr
    assert not (tmp_path / "alone").exists()  # nothing was written

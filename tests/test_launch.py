"""Launch planning and the checks that refuse a run which is not what the recipe asked for (no processes)."""

import shlex
import sys
from types import SimpleNamespace

import pytest

from workbench import Recipe, RecipeError, WorkbenchError
from workbench.distributed.accelerator import check_process_count, deepspeed_config, hybrid_shard_config, verify_launch
from workbench.distributed.launcher import check_launcher_agrees, plan_launch
from workbench.estimator.layout_choice import resolve as resolve_layout
from workbench.frontends.cli import main
from workbench.hardware.current import world_size_from_env
from workbench.hardware.precision import resolve
from workbench.spec.strategies import DDP, FSDP, SINGLE, ZERO3

RECIPE = "recipes/tiny.yaml"
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "PMI_SIZE",
                    "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "ACCELERATE_MIXED_PRECISION",
                    "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


@pytest.fixture(autouse=True)
def clean_launch_env(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_one_process_runs_train_directly():
    plan = plan_launch(RECIPE, ["training.lr=1e-3"], nproc=1, train_args=["--overwrite"])
    assert plan.command == [sys.executable, "-m", "workbench", "train", RECIPE, "training.lr=1e-3", "--overwrite"]


def test_several_processes_go_through_accelerate_launch_multi_gpu():
    plan = plan_launch(RECIPE, ["distributed.strategy=fsdp"], nproc=4, master="10.0.0.1:29400")
    cmd = plan.command
    assert cmd[1:4] == ["-m", "accelerate.commands.launch", "--multi_gpu"]  # a route that really starts N ranks
    assert "--cpu" not in cmd  # --cpu silently starts ONE process
    flags = dict(zip(cmd[3::], cmd[4::]))
    assert flags["--num_processes"] == "4" and flags["--main_process_ip"] == "10.0.0.1"
    assert flags["--main_process_port"] == "29400"
    assert flags["--mixed_precision"] == resolve(Recipe.load(RECIPE), "cpu").mixed_precision  # auto, resolved
    assert cmd[-5:] == ["-m", "workbench", "train", RECIPE, "distributed.strategy=fsdp"]
    assert shlex.split(plan.shell().split(" ", 2)[-1])[0] == sys.executable


def test_multi_node_plan_counts_every_process_and_uses_a_static_rendezvous():
    plan = plan_launch(RECIPE, [], nproc=8, nnodes=4, node_rank=2, master="10.0.0.1:29400")
    flags = dict(zip(plan.command[3::], plan.command[4::]))
    assert (flags["--num_processes"], flags["--num_machines"], flags["--machine_rank"]) == ("32", "4", "2")
    assert flags["--rdzv_backend"] == "static" and plan.env["NUM_NODES"] == "4"


@pytest.mark.parametrize("kwargs, field", [
    ({"nproc": 0}, "--nproc"), ({"nnodes": 2, "node_rank": 2}, "--node-rank"), ({"master": "nohost"}, "--master"),
])
def test_bad_launch_flags_name_the_flag(kwargs, field):
    with pytest.raises(RecipeError, match=field):
        plan_launch(RECIPE, [], **kwargs)


def test_bad_recipe_fails_before_any_process_starts(capsys):
    assert main(["launch", RECIPE, "--nproc", "2", "--dry-run", "training.lrr=1"]) == 2
    assert "training.lrr" in capsys.readouterr().err


def test_dry_run_prints_the_command(capsys):
    assert main(["launch", RECIPE, "--nproc", "2", "--dry-run", "distributed.strategy=ddp"]) == 0
    out = capsys.readouterr().out
    assert "accelerate.commands.launch --multi_gpu --num_processes 2" in out and "OMP_NUM_THREADS=" in out


def test_one_process_cannot_shard():
    recipe = Recipe.load(RECIPE).override("distributed.strategy=fsdp")
    with pytest.raises(RecipeError, match="distributed.strategy: fsdp shards across processes"):
        resolve_layout(recipe, 1)
    _, layout, why = resolve_layout(Recipe.load(RECIPE), 1)
    assert (layout, why) == (SINGLE, "one process")


def test_auto_asks_the_estimator_and_says_why():
    _, layout, why = resolve_layout(Recipe.load(RECIPE), 2)
    assert layout == DDP and why.startswith("auto: ddp is the first layout that fits")  # a tiny replica fits anywhere


def test_an_accelerate_config_that_contradicts_the_recipe_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeError, match="the recipe runs ddp, but the accelerate launch configuration asks for fsdp"):
        check_launcher_agrees("ddp")
    check_launcher_agrees("fsdp")


def test_one_process_from_a_multi_process_accelerate_launch_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    check_process_count()  # accelerate launch with one process: fine
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # set only when more than one process was asked for
    with pytest.raises(WorkbenchError, match="asked for several processes but started one"):
        check_process_count()
    monkeypatch.setenv("PMI_SIZE", "2")  # an MPI launch carries its world size in its own variable
    assert world_size_from_env() == 2
    check_process_count()


@pytest.mark.parametrize("strategy, came_up, ok", [
    (DDP, "DistributedType.MULTI_CPU", True), (FSDP, "DistributedType.FSDP", True),
    (FSDP, "DistributedType.MULTI_CPU", False), (ZERO3, "DistributedType.MULTI_GPU", False),
    (ZERO3, "DistributedType.DEEPSPEED", True),
])
def test_a_silent_fallback_to_another_distributed_type_is_refused(monkeypatch, strategy, came_up, ok):
    monkeypatch.setenv("WORLD_SIZE", "2")
    accelerator = SimpleNamespace(num_processes=2, distributed_type=came_up)
    if ok:
        verify_launch(accelerator, strategy)
    else:
        with pytest.raises(WorkbenchError, match="a silent fallback"):
            verify_launch(accelerator, strategy)


def test_ranks_that_do_not_form_one_run_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # two processes started, each alone
    with pytest.raises(WorkbenchError, match="do not form one run"):
        verify_launch(SimpleNamespace(num_processes=1, distributed_type="DistributedType.NO"), DDP)


def test_deepspeed_config_comes_from_the_recipe():
    recipe = Recipe.load(RECIPE).override(
        "distributed.strategy=deepspeed", "distributed.deepspeed.stage=3", "distributed.deepspeed.offload_params=cpu",
        "training.micro_batch_size=3", "training.max_grad_norm=0.5", "training.mixed_precision=bf16")
    config = deepspeed_config(recipe)
    assert config["zero_optimization"]["stage"] == 3 and config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 1
    assert config["bf16"]["enabled"] and config["gradient_clipping"] == 0.5


def test_a_user_deepspeed_file_must_agree_with_the_recipe_batch(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 16}')
    recipe = Recipe.load(RECIPE).override(f"distributed.deepspeed.config_file={path}")
    with pytest.raises(RecipeError, match="train_micro_batch_size_per_gpu is 16, but the recipe needs 4"):
        deepspeed_config(recipe)
    path.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')
    assert deepspeed_config(recipe)["train_micro_batch_size_per_gpu"] == 4


def test_a_zero3_run_always_keeps_the_whole_weights_it_saves_its_adapter_from(tmp_path):
    """ZeRO-3 saves the adapter from the 16-bit weights it gathers at save: a user file that leaves the setting out
    gets it; one that turns it off, or a recipe that does, is refused before the run (it used to train every step
    and then fail at the save, with a traceback)."""
    from workbench.spec.strategies import ZERO3, layout_problem

    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    recipe = Recipe.load(RECIPE).override(f"distributed.deepspeed.config_file={path}")
    assert deepspeed_config(recipe)["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    path.write_text('{"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": false}}')
    with pytest.raises(RecipeError, match=r"config_file: .*ds\.json sets zero_optimization\.stage3_gather_16bit"):
        deepspeed_config(recipe)
    with pytest.raises(RecipeError, match="distributed.deepspeed.save_16bit_model: false leaves ZeRO-3"):
        Recipe.load(RECIPE).override("distributed.strategy=deepspeed", "distributed.deepspeed.stage=3",
                                     "distributed.deepspeed.save_16bit_model=false")  # named: refused as it loads
    auto = Recipe.load(RECIPE).override("distributed.deepspeed.save_16bit_model=false")  # auto: once it resolves
    assert "distributed.deepspeed.save_16bit_model: false" in layout_problem(auto, ZERO3)
    # the bucket sizes follow the model's width (accelerate fills `auto`), not DeepSpeed's 5e8-element default
    zero = deepspeed_config(Recipe.load(RECIPE).override("distributed.strategy=deepspeed",
                                                         "distributed.deepspeed.stage=3"))["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] == "auto"


@pytest.mark.parametrize("text, message", [
    ('{"zero_optimization": {"stage": "auto"}}', "zero_optimization.stage: must be 0, 1, 2 or 3, got 'auto'"),
    ('{"zero_optimization": {"stage": "3"}}', "zero_optimization.stage: must be 0, 1, 2 or 3, got '3'"),
    ('{"zero_optimization": {"stage": true}}', "zero_optimization.stage: must be 0, 1, 2 or 3, got True"),
    ('{"zero_optimization": {"stage": 4}}', "zero_optimization.stage: must be 0, 1, 2 or 3, got 4"),
    ('{"zero_optimization": []}', "zero_optimization: must be an object, got a list"),
    ('{"zero_optimization": {"offload_param": "cpu"}}', "zero_optimization.offload_param: must be an object"),
    ('{"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}',
     "zero_optimization.offload_optimizer.device: must be none, cpu or nvme, got 'gpu'"),
    ('{"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "false"}}',
     "zero_optimization.stage3_gather_16bit_weights_on_model_save: must be true or false, got 'false'"),
    ('[]', "must hold a JSON object, got a list"),
])
def test_a_deepspeed_file_s_zero_section_is_read_in_one_place_and_refused_in_one_line(tmp_path, capsys, text,
                                                                                       message):
    """The layout, the accelerator's config and `validate` read the same checked section: a stage written as text
    used to pass the accelerator's ZeRO-3 gather check (stage == 3) while the layout ran ZeRO-3."""
    from workbench.spec.strategies import layout_of

    path = tmp_path / "ds.json"
    path.write_text(text)
    recipe = Recipe.load(RECIPE).override("distributed.strategy=deepspeed", f"distributed.deepspeed.config_file={path}")
    expected = f"{path}: {message}"
    for read in (lambda: layout_of(recipe, 2), lambda: deepspeed_config(recipe)):
        with pytest.raises(RecipeError) as caught:
            read()
        assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)
    recipe.save(tmp_path / "recipe.yaml")
    assert main(["validate", str(tmp_path / "recipe.yaml")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {expected}")


def test_validate_reads_a_deepspeed_file_and_its_layout(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}')
    recipe = Recipe.load(RECIPE).override("distributed.strategy=deepspeed", f"distributed.deepspeed.config_file={path}")
    recipe.save(tmp_path / "recipe.yaml")
    assert main(["validate", str(tmp_path / "recipe.yaml")]) == 0
    path.write_text('{"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": false}}')
    assert main(["validate", str(tmp_path / "recipe.yaml")]) == 2
    assert "stage3_gather_fp16_weights_on_model_save false" in capsys.readouterr().err
    # the old name of the gather setting is replaced, not doubled (DeepSpeed refuses a file with both)
    path.write_text('{"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": true}}')
    zero = deepspeed_config(recipe)["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert "stage3_gather_fp16_weights_on_model_save" not in zero


def test_hybrid_shard_needs_several_machines_of_several_processes(monkeypatch):
    recipe = Recipe.load(RECIPE).override("distributed.fsdp.sharding=hybrid")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    config = hybrid_shard_config(recipe)
    assert (config.dp_replicate_size, config.dp_shard_size) == (2, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(RecipeError, match="distributed.fsdp.sharding: hybrid needs several machines"):
        hybrid_shard_config(recipe)
    assert hybrid_shard_config(Recipe.load(RECIPE)) is None


@pytest.mark.parametrize("kind", ["fifo", "device", "huge", "nan"])
def test_a_deepspeed_file_that_is_no_config_is_one_line_without_waiting_or_filling_memory(tmp_path, kind):
    """A FIFO blocked `validate` forever and /dev/zero read until memory ran out: only a regular file of a config's
    size is read, and JSON's NaN is no number."""
    import os

    from workbench.spec.strategies import DEEPSPEED_FILE_LIMIT, read_deepspeed_file

    path = tmp_path / "ds.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = "/dev/zero"
    elif kind == "huge":
        path.write_text('{"zero_optimization": {"stage": 2}, "pad": "' + "x" * DEEPSPEED_FILE_LIMIT + '"}')
    else:
        path.write_text('{"gradient_clipping": NaN}')
    why = {"fifo": "not a regular file", "device": "not a regular file", "huge": "larger than 1024 KiB",
           "nan": "NaN is not a JSON number"}[kind]
    with pytest.raises(RecipeError, match=f"config_file: cannot read {path}: {why}"):
        read_deepspeed_file(path)

"""The one home of the distributed layouts: names, what each shards and offloads, `auto`, and the
compatibility rules checked on the layout that really runs (no processes are started here)."""

import pytest

from workbench import Recipe, RecipeError
from workbench.estimator.layout_choice import resolve
from workbench.estimator.memory import estimate
from workbench.spec.strategies import (DDP, FSDP, FSDP_HYBRID, FSDP_OFFLOAD, SINGLE, ZERO1, ZERO2, ZERO3,
                                       ZERO3_OFFLOAD, Layout, by_name, candidates, layout_of)

RECIPE = "recipes/tiny.yaml"


def tiny(*overrides):
    return Recipe.load(RECIPE, list(overrides))


@pytest.mark.parametrize("layout, shards, offloads", [
    (SINGLE, (), ()), (DDP, (), ()), (ZERO1, ("optimizer",), ()), (ZERO2, ("optimizer", "gradients"), ()),
    (ZERO3, ("weights", "adapter", "gradients", "optimizer"), ()),
    (FSDP, ("weights", "adapter", "gradients", "optimizer"), ()),
    (FSDP_OFFLOAD, ("weights", "adapter", "gradients", "optimizer"), ("weights", "adapter", "gradients", "optimizer")),
    (ZERO3_OFFLOAD, ("weights", "adapter", "gradients", "optimizer"), ("optimizer", "weights", "adapter", "gradients")),
])
def test_each_layout_says_what_it_shards_and_offloads(layout, shards, offloads):
    assert layout.shards == shards and layout.offloads == offloads
    assert by_name(layout.name) == layout if layout != SINGLE else True
    assert Layout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize("overrides, expected", [
    (["distributed.strategy=ddp"], DDP),
    (["distributed.strategy=deepspeed", "distributed.deepspeed.stage=1"], ZERO1),
    (["distributed.strategy=deepspeed", "distributed.deepspeed.stage=3", "distributed.deepspeed.offload_params=cpu",
      "distributed.deepspeed.offload_optimizer=cpu"], ZERO3_OFFLOAD),
    (["distributed.strategy=fsdp", "distributed.fsdp.sharding=hybrid"], FSDP_HYBRID),
    (["distributed.strategy=fsdp", "distributed.fsdp.cpu_offload=true"], FSDP_OFFLOAD),
])
def test_a_named_strategy_runs_the_layout_its_settings_describe(overrides, expected):
    recipe, layout, why = resolve(tiny(*overrides), 2)
    assert layout == expected and why == "set in the recipe"
    assert layout_of(recipe, 2) == expected  # the resolved recipe carries the layout's settings


def test_a_deepspeed_json_decides_the_layout(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}')
    recipe = tiny("distributed.strategy=deepspeed", f"distributed.deepspeed.config_file={config}")
    assert layout_of(recipe, 2) == Layout("deepspeed", 3, offload_optimizer=True)


def memory_between(recipe, world, smaller: str, larger: str) -> int:
    """A machine memory in which `smaller`'s processes fit and `larger`'s do not (CPU: all processes share it)."""
    rows = {s["name"]: s["cpu_bytes"] for s in estimate(recipe, world_size=world, device="cpu").strategies}
    assert rows[smaller] < rows[larger]
    return (rows[smaller] + rows[larger]) // 2


def test_auto_runs_the_complete_layout_it_chose():
    """Where no replica fits, auto resolves to a sharded layout, and the recipe it returns builds exactly that
    (the stage and sharding, not the recipe's own deepspeed/fsdp defaults)."""
    recipe = tiny()
    memory = memory_between(recipe, 2, "fsdp", "ddp")  # the ZeRO layouts hold DeepSpeed's import too
    resolved, layout, why = resolve(recipe.override(distributed__device_memory=memory), 2)
    assert layout == FSDP and why.startswith("auto: fsdp is the first layout that fits")
    assert layout_of(resolved, 2) == FSDP and resolved.distributed.strategy == "fsdp"


def test_auto_skips_the_layouts_the_recipe_cannot_run_and_says_so():
    """QLoRA with uint8 storage cannot be sharded: auto must not pick FSDP or ZeRO-3 for it."""
    recipe = tiny("adapter.method=qlora", "model.dtype=float32", "training.mixed_precision=no")
    rows = {s["name"]: s["cpu_bytes"] for s in estimate(recipe, world_size=2, device="cpu").strategies}
    memory = (rows["fsdp"] + rows["ddp"]) // 2  # only a sharded layout fits ...
    with pytest.raises(RecipeError, match=r"auto found no layout that fits .*\(fsdp, zero3.* not allowed"):
        resolve(recipe.override(distributed__device_memory=memory), 2)
    roomy = recipe.override(distributed__device_memory=rows["ddp"] * 2)  # ... and with room, a replica
    assert resolve(roomy, 2)[1] == DDP


def test_compatibility_is_checked_on_the_resolved_layout(tmp_path):
    """A named strategy is refused at validation; a DeepSpeed JSON that says stage 3 when the layout resolves."""
    with pytest.raises(RecipeError, match="quantization.quant_storage: sharding 4-bit weights"):
        tiny("adapter.method=qlora", "distributed.strategy=deepspeed", "distributed.deepspeed.stage=3")
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3}}')
    recipe = tiny("adapter.method=qlora", "distributed.strategy=deepspeed",
                  f"distributed.deepspeed.config_file={config}")  # valid on its own ...
    with pytest.raises(RecipeError, match=r"quantization.quant_storage: .* \(layout zero3: set in the recipe\)"):
        resolve(recipe, 2)  # ... refused for the layout it runs


def test_the_estimator_and_auto_consider_the_same_layouts():
    """... and the estimator shows pipeline parallel after them, which `auto` never chooses (named only)."""
    names = [s["name"] for s in estimate(tiny(), world_size=4, nodes=2, device="cpu").strategies]
    assert names == [layout.name for layout in candidates(4, 2)] + ["pp"]
    assert "fsdp_hybrid" in names and names[0] == "ddp"


@pytest.mark.parametrize("value", ["lots", "-3GB", "0"])
def test_a_bad_device_memory_names_the_field(value):
    with pytest.raises(RecipeError, match="distributed.device_memory: device memory"):
        tiny(f"distributed.device_memory={value}")


@pytest.mark.parametrize("override, message", [
    ("distributed.timeout_s=0", "distributed.timeout_s: Input should be greater than or equal to 1"),
    ("distributed.timeout_s=1e-9", "distributed.timeout_s: Input should be greater than or equal to 1"),
    ("distributed.timeout_s=true", "distributed.timeout_s: expected a number of seconds"),
    ("distributed.startup_timeout_s=1e300", "distributed.startup_timeout_s: Input should be less than or equal"),
    ("distributed.device_memory=.inf", "distributed.device_memory: device memory: cannot read"),
    ("distributed.device_memory=0.5", "distributed.device_memory: device memory: 0.5 is 0 bytes"),
])
def test_bad_distributed_limits_name_the_field(override, message):
    with pytest.raises(RecipeError, match=message):
        tiny(override)


def test_estimate_plans_for_the_recipes_device_memory():
    est = estimate(tiny("distributed.device_memory=3GiB"), world_size=2, device="cpu")
    assert est.device["memory_bytes"] == 3 * 2**30


def test_a_run_without_deepspeed_never_imports_it():
    """distributed.unwrap peels what Accelerate's unwrap would (its mixed-precision forward included) without the
    import of DeepSpeed that costs every process seconds and ~130 MiB; the estimator charges it to DeepSpeed alone."""
    import subprocess
    import sys

    code = """
import sys, torch
from accelerate import Accelerator
from workbench.distributed.accelerator import full_state_dict, unwrap
accelerator = Accelerator(cpu=True, mixed_precision="bf16")
model = accelerator.prepare(torch.nn.Linear(4, 4))
assert "_original_forward" in model.__dict__
assert full_state_dict(accelerator, model).keys() == {"weight", "bias"}
plain = unwrap(accelerator, model, keep_fp32_wrapper=False)
assert plain is model and "_original_forward" not in plain.__dict__
assert plain(torch.ones(1, 4)).dtype == torch.float32  # the autocast wrapper is gone
assert "deepspeed" not in sys.modules
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    rows = {row["name"]: row for row in estimate(Recipe.load("recipes/tiny.yaml"), world_size=2, device="cpu").strategies}
    assert rows["zero2"]["breakdown"]["other"] > rows["ddp"]["breakdown"]["other"]


@pytest.mark.parametrize("world, nodes", [(1, 1), (2, 1), (4, 2)])
def test_every_layout_names_a_device_mesh_of_the_launch(world, nodes):
    """The estimate's rows (the CLI's table, the UI's Estimate tab) name each layout's mesh; its sizes multiply to
    the processes launched."""
    import math

    rows = estimate(Recipe.load(RECIPE), world_size=world, nodes=nodes, device="H100").strategies
    assert rows
    for row in rows:
        assert math.prod(row["mesh"].values()) == world, row["name"]
    meshes = {row["name"]: row["mesh"] for row in rows}
    if world == 1:  # (the other layouts' rows are there for comparison: one process, no mesh)
        assert meshes["single"] == {} and not any(meshes.values())
    else:
        assert meshes["ddp"] == {"dp": world} and meshes["fsdp"] == {"dp_shard": world}
        assert meshes["tp"] == {"tp": world} and meshes["pp"] == {"pp": world}
    if nodes > 1:
        assert meshes["fsdp_hybrid"] == {"dp_replicate": nodes, "dp_shard": world // nodes}

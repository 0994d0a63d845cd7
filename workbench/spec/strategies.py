"""Every distributed layout the workbench runs, in one place.

A layout is a complete answer to "how do the processes share the work": the recipe's strategy word
(single, ddp, fsdp, deepspeed) plus the settings that change what each process holds (ZeRO stage,
offload, full or hybrid sharding). The memory estimator reads which parts a layout shards or offloads,
the rules of which recipes a layout can run live here (`layout_problem`), `auto` resolves to a layout
(workbench/estimator/layout_choice.py), the accelerator is built from it (workbench/distributed/accelerator.py) and checkpoints
record it (workbench/training/checkpoints.py). Adding a layout touches this module, its plugin builder and the recipe
schema.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.base.errors import RecipeError, escaped
from workbench.spec import adapter_init
from workbench.spec.objectives import DEFAULT_OBJECTIVE, OBJECTIVES

if TYPE_CHECKING:
    from workbench.spec.recipe import Recipe

PARTS = ("weights", "adapter", "gradients", "optimizer")


@dataclass(frozen=True)
class Layout:
    strategy: str  # the recipe's distributed.strategy word
    stage: int = 0  # ZeRO stage (deepspeed)
    hybrid: bool = False  # fsdp: shard within a machine, replicate across machines
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def name(self) -> str:
        """The name the estimator, run.json and the docs use: ddp, zero2_offload, fsdp_hybrid, ..."""
        if self.strategy == "deepspeed":
            return f"zero{self.stage}" + ("_offload" if self.offload_optimizer or self.offload_params else "")
        if self.strategy == "fsdp":
            return "fsdp" + ("_hybrid" if self.hybrid else "") + ("_offload" if self.offload_params else "")
        return self.strategy

    @property
    def shards(self) -> tuple[str, ...]:
        """The parts of a training process split across the processes (of one machine, when hybrid)."""
        if self.strategy == "fsdp" or self.stage == 3:
            return PARTS
        return {1: ("optimizer",), 2: ("optimizer", "gradients")}.get(self.stage, ())

    @property
    def offloads(self) -> tuple[str, ...]:
        """The parts kept in CPU memory instead of the device's."""
        if self.strategy == "fsdp":  # FSDP2's offload policy moves parameters, gradients and the optimizer
            return PARTS if self.offload_params else ()
        parts = ("optimizer",) if self.offload_optimizer else ()
        return parts + (("weights", "adapter", "gradients") if self.offload_params else ())

    @property
    def shards_weights(self) -> bool:
        return "weights" in self.shards

    @property
    def splits_layers(self) -> bool:
        """Tensor parallel: each process holds a slice of every split layer's weights (and of its adapter, its
        gradients and their optimizer states) and computes its share of each layer on the same batch."""
        return self.strategy == "tp"

    @property
    def pipelines(self) -> bool:
        """Pipeline parallel: each process holds a contiguous run of the decoder layers (a stage; the embeddings on
        the first, the final norm and the head on the last), and the step's micro-batches flow through the stages
        in a torch.distributed.pipelining schedule (workbench/distributed/pipeline.py)."""
        return self.strategy == "pp"

    @property
    def reads_own_batches(self) -> bool:
        """Whether each process reads batches of its own (data parallel); a tensor-parallel group and a pipeline's
        stages read the same."""
        return not (self.splits_layers or self.pipelines)

    def mesh(self, world_size: int, nodes: int = 1) -> dict[str, int]:
        """The device mesh this layout runs on `world_size` processes over `nodes` machines, by dimension (the
        names accelerate's ParallelismConfig gives them; `dp` for DDP and ZeRO, whose engines keep no mesh)."""
        if world_size == 1:
            return {}
        if self.splits_layers:
            return {"tp": world_size}
        if self.pipelines:
            return {"pp": world_size}
        if self.hybrid:
            return {"dp_replicate": nodes, "dp_shard": world_size // nodes}
        return {"dp_shard": world_size} if self.strategy == "fsdp" else {"dp": world_size}

    def batch_streams(self, world_size: int) -> int:
        """How many different batches a micro-batch round reads on `world_size` processes: one a process, or one
        a tensor-parallel group or a pipeline (all of them, today). A step's samples and a place in the epoch
        count in these."""
        return world_size if self.reads_own_batches else 1

    @property
    def distributed_types(self) -> frozenset[str]:
        """Accelerate's DistributedType names this layout may come up as (anything else is a silent fallback)."""
        return frozenset({"single": {"NO"}, "ddp": {"MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU"},
                          "fsdp": {"FSDP"}, "deepspeed": {"DEEPSPEED"},
                          # accelerate's tensor parallel runs on a multi-device state (on a CPU: labelled one)
                          "tp": {"MULTI_GPU"},
                          # a pipeline's process group is DDP's (accelerate has no pipeline of its own; the model
                          # is not wrapped)
                          "pp": {"MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU"}}[self.strategy])

    @property
    def launch_flag(self) -> str | None:
        """The environment variable an accelerate config sets to ask for this strategy (workbench/distributed/launcher.py)."""
        return {"fsdp": "ACCELERATE_USE_FSDP", "deepspeed": "ACCELERATE_USE_DEEPSPEED"}.get(self.strategy)

    # -- memory (workbench/estimator/memory.py) ------------------------------------------------------------------

    @property
    def gradient_copies(self) -> int:
        """Copies of the gradients a process holds: DDP's communication buckets keep a second one."""
        return 2 if self.strategy == "ddp" else 1

    @property
    def keeps_master_weights(self) -> bool:
        """Whether the optimizer side holds fp32 master copies of 16-bit trainable weights (DeepSpeed does)."""
        return self.strategy == "deepspeed"

    # -- checkpoints (workbench/training/checkpoints.py) --------------------------------------------------------

    @property
    def save_state_options(self) -> dict:
        """For accelerator.save_state: DeepSpeed writes its own engine files, and must leave the frozen base out."""
        return {"exclude_frozen_parameters": True} if self.strategy == "deepspeed" else {}

    @property
    def load_state_options(self) -> dict:
        """For accelerator.load_state: checkpoints hold trainable weights only (DeepSpeed names it its own way)."""
        return {"load_module_strict": False} if self.strategy == "deepspeed" else {"strict": False}

    @property
    def gathers_through_deepspeed(self) -> bool:
        """Whole weights and optimizer moments come from DeepSpeed's fragments, not torch's state-dict API."""
        return self.strategy == "deepspeed"

    @property
    def loads_portable_state(self) -> bool:
        """Whether a checkpoint written on another layout or process count can be loaded into this one."""
        return self.strategy != "deepspeed"  # a ZeRO engine loads only its own partitions

    @property
    def keeps_engine_state(self) -> bool:
        """Whether a checkpoint holds the engine's own copy (accelerator.save_state) beside the portable one.
        Accelerate writes a tensor-parallel model's DTensor slices as if whole, and only the main process's
        optimizer slices: its checkpoints hold the portable copy alone (gathered whole), which every layout
        but ZeRO's loads, this one included. A pipeline's stages have no engine (accelerate does not prepare the
        model): its checkpoints too hold the portable copy alone, gathered from the stages."""
        return not (self.splits_layers or self.pipelines)

    def settings(self) -> dict:
        """The recipe fields (as overrides) that make a recipe run this layout."""
        values: dict = {"distributed.strategy": self.strategy}
        if self.strategy == "deepspeed":
            values.update({"distributed.deepspeed.stage": self.stage,
                           "distributed.deepspeed.offload_optimizer": "cpu" if self.offload_optimizer else "none",
                           "distributed.deepspeed.offload_params": "cpu" if self.offload_params else "none"})
        if self.strategy == "fsdp":
            values.update({"distributed.fsdp.sharding": "hybrid" if self.hybrid else "full",
                           "distributed.fsdp.cpu_offload": self.offload_params})
        return values

    def to_json(self) -> dict:
        return {"name": self.name, "strategy": self.strategy, "stage": self.stage, "hybrid": self.hybrid,
                "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params,
                "shards": list(self.shards), "offloads": list(self.offloads)}

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        return cls(data["strategy"], int(data.get("stage", 0)), bool(data.get("hybrid")),
                   bool(data.get("offload_optimizer")), bool(data.get("offload_params")))


MESH_ABBREVIATIONS = {"dp_replicate": "rep", "dp_shard": "shard"}


def schedule_problem(micro_batches: int, stages: int, schedule: str) -> str | None:
    """Why a pipeline of `stages` processes cannot run `micro_batches` a step on its schedule (None: it can).
    Needs the process count: `workbench launch` asks before any process starts, each stage again as it builds."""
    if schedule == "1f1b" and micro_batches < stages:
        return (f"training.grad_accum: {micro_batches} micro-batches a step, fewer than the {stages} pipeline "
                "stages, which the 1f1b schedule needs (with fewer, most stages would wait most of the step); raise "
                "grad_accum to at least the process count, or set distributed.pipeline.schedule: gpipe")
    return None


def mesh_text(mesh: dict[str, int], short: bool = False) -> str:
    """A layout's device mesh (Layout.mesh) in a table cell: "dp_replicate=2 x dp_shard=4" ("rep2xshard4",
    short); "-" for one process."""
    if short:
        return "x".join(f"{MESH_ABBREVIATIONS.get(name, name)}{size}" for name, size in mesh.items()) or "-"
    return " x ".join(f"{name}={size}" for name, size in mesh.items()) or "-"


SINGLE, DDP = Layout("single"), Layout("ddp")
ZERO1, ZERO2, ZERO3 = (Layout("deepspeed", stage) for stage in (1, 2, 3))
FSDP, FSDP_HYBRID = Layout("fsdp"), Layout("fsdp", hybrid=True)
FSDP_OFFLOAD = Layout("fsdp", offload_params=True)
ZERO2_OFFLOAD = Layout("deepspeed", 2, offload_optimizer=True)
ZERO3_OFFLOAD = Layout("deepspeed", 3, offload_optimizer=True, offload_params=True)
TP = Layout("tp")
PP = Layout("pp")


def candidates(world_size: int, nodes: int = 1) -> list[Layout]:
    """The layouts `auto` and the estimator consider, in order of preference: least communication and
    host traffic first."""
    layouts = [SINGLE if world_size == 1 else DDP, ZERO1, ZERO2]
    layouts += [FSDP_HYBRID] if nodes > 1 else []
    layouts += [FSDP, ZERO3, FSDP_OFFLOAD, ZERO2_OFFLOAD, ZERO3_OFFLOAD]
    # tensor parallel last: a collective in every layer, worth it where a layer's weights do not fit a device
    return layouts + ([TP] if world_size > 1 else [])


def by_name(name: str) -> Layout:
    for layout in [*candidates(2, 2), PP]:  # a pipeline is never chosen by `auto`: named only
        if layout.name == name:
            return layout
    raise RecipeError(f"distributed: unknown layout {name!r} (known: "
                      f"{', '.join(l.name for l in [SINGLE, *candidates(2, 2), PP])})")


def layout_of(recipe: "Recipe", world_size: int) -> Layout:
    """The layout a recipe whose strategy is not `auto` runs on `world_size` processes."""
    dist = recipe.distributed
    if world_size == 1:
        if dist.strategy in ("fsdp", "deepspeed", "tp", "pp"):
            raise RecipeError(
                f"distributed.strategy: {dist.strategy} shards across processes, but this run has one process; "
                "launch it with `workbench launch RECIPE --nproc N` or set strategy: auto"
            )
        return SINGLE
    if dist.strategy == "deepspeed":
        ds = dist.deepspeed
        stage, offload_optimizer, offload_params = ds.stage, ds.offload_optimizer == "cpu", ds.offload_params == "cpu"
        if ds.config_file:  # the user's own DeepSpeed JSON decides what each process holds
            zero = read_deepspeed_file(ds.config_file).zero
            stage, offload_optimizer, offload_params = zero.stage, zero.offloads_optimizer, zero.offloads_params
        return Layout("deepspeed", stage, offload_optimizer=offload_optimizer, offload_params=offload_params)
    if dist.strategy == "fsdp":
        return Layout("fsdp", hybrid=dist.fsdp.sharding == "hybrid", offload_params=dist.fsdp.cpu_offload)
    if dist.strategy == "tp":
        return TP
    if dist.strategy == "pp":
        return PP
    return DDP  # ddp, or single asked of several processes: each a full replica


def layout_problem(recipe: "Recipe", layout: Layout) -> str | None:
    """Why this recipe cannot run on this layout (naming the field to change), or None.

    Checked on the layout that really runs: a named strategy's at validation, `auto`'s once resolved."""
    training, dist = recipe.training, recipe.distributed
    if training.gradient_checkpointing and dist.fsdp.activation_checkpointing and layout.strategy == "fsdp":
        return ("distributed.fsdp.activation_checkpointing: training.gradient_checkpointing is already on; "
                "use one of the two")
    if training.on_nonfinite == "skip" and layout.strategy == "deepspeed":
        return ("training.on_nonfinite: skip is not possible under DeepSpeed, whose engine applies the update inside "
                "backward; use on_nonfinite: stop (the last good checkpoint is kept) or strategy fsdp/ddp")
    if training.optimizer != "adamw" and layout.strategy == "deepspeed":
        return (f"training.optimizer: {training.optimizer} is a bitsandbytes optimizer; DeepSpeed needs adamw "
                "(use distributed.deepspeed.offload_optimizer: cpu to save optimizer memory)")
    if layout.strategy == "deepspeed" and layout.shards_weights and not dist.deepspeed.save_16bit_model:
        # (a config_file's own setting is checked as it is read: distributed/accelerator.py)
        return ("distributed.deepspeed.save_16bit_model: false leaves ZeRO-3 no whole weights to save the adapter "
                "from when the run ends; set it true")
    if training.objective_spec.samples_answers and layout.strategy not in ("single", "ddp"):
        # each process samples its own prompts' answers with model.generate, which needs the whole model in reach
        return (f"training.objective: {training.objective} samples answers inside the loop on each process's whole "
                f"model, which {layout.name} splits or wraps in its own engine; use distributed.strategy ddp (each "
                "process answers its own prompts) or single")
    init = adapter_init.of(recipe)
    if layout.strategy == "deepspeed" and layout.shards_weights and (init.decomposes or init.needs_data):
        # ZeRO-3 partitions the weights as they load: no whole weight is left to decompose or to run forward with
        needs = "decomposes each whole weight" if init.decomposes else "runs forward passes over the training data"
        return (f"adapter.init: {recipe.adapter.init} {needs} at start-up, which ZeRO-3 has already partitioned; use "
                "strategy fsdp, zero2, or init default/gaussian")
    if layout.splits_layers:
        problem = _tensor_parallel_problem(recipe)
        if problem:
            return problem
    if layout.pipelines:
        problem = _pipeline_problem(recipe)
        if problem:
            return problem
    q = recipe.quantization
    if q is not None and layout.shards_weights:
        if q.bits == 8:
            return f"quantization.bits: 8-bit weights cannot be sharded by FSDP or ZeRO-3 ({layout.name}); use bits: 4"
        if recipe.model.dtype == "auto" and q.quant_storage == "uint8":
            return ("quantization.quant_storage: sharding 4-bit weights needs them stored as the model dtype; "
                    "set model.dtype and quantization.quant_storage to the same dtype (e.g. bfloat16)")
        if recipe.model.dtype != "auto" and q.quant_storage != recipe.model.dtype:
            return (f"quantization.quant_storage: sharding 4-bit weights needs them stored as the model dtype; "
                    f"set quantization.quant_storage: {recipe.model.dtype}")
    return None


def _tensor_parallel_problem(recipe: "Recipe") -> str | None:
    """What tensor parallel (transformers' tp_plan, peft's LoRA on DTensor slices) does not run yet."""
    if recipe.adapter.method != "lora":
        why = {"qlora": "bitsandbytes' 4-bit weights cannot be split into DTensor slices",
               "dora": "DoRA's weight norm needs each whole row of the base weight",
               "full": "full fine-tuning under tensor parallel is not verified yet"}[recipe.adapter.method]
        return f"adapter.method: {recipe.adapter.method} under strategy tp: {why}; use method lora, or strategy fsdp"
    if recipe.adapter.modules_to_save:
        return ("adapter.modules_to_save: a module trained whole beside the adapter is not split by tensor parallel "
                "(peft's copy of a split head fails); remove it, or use strategy fsdp")
    if recipe.training.fast_paths:
        return ("training.fast_paths: its per-sample attention and chunked LM head read whole weights, and under "
                "strategy tp each process holds slices; set training.fast_paths: false")
    if recipe.training.optimizer != "adamw":
        return (f"training.optimizer: {recipe.training.optimizer} keeps bitsandbytes' quantized states, which "
                "tensor parallel's DTensor slices are not; use optimizer adamw")
    if recipe.training.objective_spec is not OBJECTIVES[DEFAULT_OBJECTIVE]:  # next-token loss only, for now
        return (f"training.objective: {recipe.training.objective} under strategy tp is not verified yet; use "
                "objective sft, or strategy fsdp")
    if adapter_init.of(recipe).changes_base or adapter_init.of(recipe).needs_data:
        return (f"adapter.init: {recipe.adapter.init} reads whole weights or runs the model at start-up, before "
                "tensor parallel splits them; use init default or gaussian")
    return None


def _pipeline_problem(recipe: "Recipe") -> str | None:
    """What pipeline parallel (workbench/distributed/pipeline.py) does not run yet. The stages' count, and
    whether the model is one the stage builder knows, are checked once the processes and the model are known
    (pipeline_stages.check_schedule, pipeline_stages.check_architecture)."""
    training, method = recipe.training, recipe.adapter.method
    if method != "lora":
        why = {"qlora": "4-bit weights on pipeline stages are not verified yet",
               "dora": "DoRA on pipeline stages is not verified yet",
               "full": "full fine-tuning on pipeline stages is not verified yet (its portable checkpoint is not kept)"}
        return f"adapter.method: {method} under strategy pp: {why[method]}; use method lora, or strategy fsdp"
    if training.objective_spec is not OBJECTIVES[DEFAULT_OBJECTIVE]:  # the last stage computes the next-token loss
        return (f"training.objective: {training.objective} under strategy pp: the last stage computes the next-token "
                "loss only; use objective sft, or strategy fsdp")
    if training.optimizer != "adamw":
        return (f"training.optimizer: {training.optimizer} under strategy pp: checkpoints gather AdamW's moments "
                "from the stages; use optimizer adamw")
    init = adapter_init.of(recipe)
    if init.changes_base or init.needs_data:
        return (f"adapter.init: {recipe.adapter.init} under strategy pp is not verified yet; use init default or "
                "gaussian")
    if recipe.data.eval is not None:
        return ("data.eval: evaluation under strategy pp is not pipelined yet (a stage holds part of the model); set "
                "data.eval: null, or evaluate the saved adapter afterwards (workbench eval)")
    if recipe.output.sample_prompts:
        return ("output.sample_prompts: generation needs the whole model, and under strategy pp each process holds "
                "one stage; leave sample_prompts empty")
    return None


@dataclass(frozen=True)
class ZeroSettings:
    """A DeepSpeed file's zero_optimization section, checked: what the layout and the accelerator act on."""
    stage: int = 0  # DeepSpeed's default when the section leaves it out
    offload_optimizer: str = "none"  # none, cpu or nvme
    offload_params: str = "none"
    gathers_16bit_weights: bool | None = None  # None: the file leaves it to us

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer != "none"

    @property
    def offloads_params(self) -> bool:
        return self.offload_params != "none"


@dataclass(frozen=True)
class DeepSpeedFile:
    config: dict  # the whole JSON, as written
    zero: ZeroSettings


ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# DeepSpeed still reads the old name, and refuses a file that gives both
GATHER_KEYS = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")


DEEPSPEED_FILE_LIMIT = 1 << 20


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_deepspeed_file(path) -> DeepSpeedFile:
    """A DeepSpeed config_file's JSON and its ZeRO settings, or one error that names the file and the field."""
    try:
        # a regular file of a config's size: a FIFO would block the reader forever, /dev/zero fill its memory
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError("not a regular file")
        with open(path, "rb") as handle:
            text = handle.read(DEEPSPEED_FILE_LIMIT + 1)
        if len(text) > DEEPSPEED_FILE_LIMIT:
            raise ValueError(f"larger than {DEEPSPEED_FILE_LIMIT // 1024} KiB, more than a DeepSpeed config holds")
        config = json.loads(text, parse_constant=_no_constant)
    except (OSError, ValueError) as err:  # ValueError: bad JSON, or a NUL byte in the path
        raise RecipeError(f"distributed.deepspeed.config_file: cannot read {escaped(path)}: "
                          f"{getattr(err, 'strerror', None) or err}") from None
    if not isinstance(config, dict):
        raise RecipeError(f"{escaped(path)}: must hold a JSON object, got {_json_kind(config)}")
    return DeepSpeedFile(config, _zero_settings(config.get("zero_optimization"), path))


def _zero_settings(section, path) -> ZeroSettings:
    if section is None:
        return ZeroSettings()
    if not isinstance(section, dict):
        raise RecipeError(f"{escaped(path)}: zero_optimization: must be an object, got {_json_kind(section)}")
    stage = section.get("stage", 0)
    if type(stage) is not int or stage not in ZERO_STAGES:  # not "3": the accelerator compares numbers
        raise RecipeError(f"{escaped(path)}: zero_optimization.stage: must be 0, 1, 2 or 3, got {stage!r}")
    gathers = _gather_setting(section, path)
    if stage == 3 and gathers is False:
        raise RecipeError(f"distributed.deepspeed.config_file: {escaped(path)} sets zero_optimization."
                          f"{next(key for key in GATHER_KEYS if key in section)} false; ZeRO-3 runs save their "
                          "adapter from the gathered 16-bit weights: set it true or leave it out")
    return ZeroSettings(stage, _offload_device(section, "offload_optimizer", path),
                        _offload_device(section, "offload_param", path), gathers)


def _offload_device(section: dict, key: str, path) -> str:
    offload = section.get(key)
    if offload is None:
        return "none"
    if not isinstance(offload, dict):
        raise RecipeError(f"{escaped(path)}: zero_optimization.{key}: must be an object, got {_json_kind(offload)}")
    device = offload.get("device", "none")
    if device is None:
        return "none"
    if device not in OFFLOAD_DEVICES:
        raise RecipeError(f"{escaped(path)}: zero_optimization.{key}.device: must be none, cpu or nvme, "
                          f"got {device!r}")
    return device


def _gather_setting(section: dict, path) -> bool | None:
    for key in GATHER_KEYS:
        value = section.get(key)
        if value is not None and not isinstance(value, bool):
            raise RecipeError(f"{escaped(path)}: zero_optimization.{key}: must be true or false, got {value!r}")
    if all(key in section for key in GATHER_KEYS):
        raise RecipeError(f"{escaped(path)}: zero_optimization: sets both {' and '.join(GATHER_KEYS)}; keep "
                          f"{GATHER_KEYS[0]}")
    return next((section[key] for key in GATHER_KEYS if section.get(key) is not None), None)


def _json_kind(value) -> str:
    """The JSON name of a value's type, as the user wrote it."""
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(value), "a number")

"""recipe.distributed → one configured Accelerator. Accelerate, PyTorch and DeepSpeed do the work.

The launch flags never decide the strategy: the recipe does, through the plugin built here. After the
Accelerator exists, `verify_launch` compares what actually came up (process count, distributed type)
with what was asked for, because several launch routes fall back silently (see the README).
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from types import MethodType

import torch

from workbench.base.errors import RecipeError, WorkbenchError
from workbench.distributed.pipeline import gather_on_main
from workbench.distributed.trackers import tensorboard_dir
from workbench.hardware.current import (available_cpus, local_kind, node_count, process_alive, processes_per_node,
                                        world_size_from_env)
from workbench.model.tensor_parallel import whole_tensors
from workbench.spec.recipe import Recipe
from workbench.spec.strategies import GATHER_KEYS, Layout, read_deepspeed_file

# where launchers put the world size: torchrun (and accelerate launch --multi_gpu), then MPI flavours
def check_process_count() -> None:
    """Refuse the silent fallback of `accelerate launch --num_processes N` to ONE process.

    Its simple launcher (chosen with --cpu, or without --multi_gpu on a machine with no GPUs) sets
    MASTER_ADDR for a multi-process launch and then starts a single process with no world size.
    """
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    if launched_by_accelerate and "MASTER_ADDR" in os.environ and world_size_from_env() == 1:
        raise WorkbenchError(
            "accelerate launch was asked for several processes but started one (it does so with --cpu, or "
            "without --multi_gpu when no GPU is visible); use `workbench launch RECIPE --nproc N`, or add "
            "--multi_gpu to accelerate launch"
        )


def release_accelerator_state() -> None:
    """After a run: Accelerate's process-wide state (precision, accumulation) goes, so the caller's own
    Accelerator afterwards starts as it would have (the process group in PartialState stays open)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def build_accelerator(recipe: Recipe, project_dir: str, layout: Layout):
    """The Accelerator that runs `layout`, with collectives that give up after distributed.timeout_s."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    # Accelerate keeps its state in process-wide singletons; a notebook that trains twice with
    # different precisions needs a fresh one (the process group in PartialState is kept).
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    on_gpu = local_kind() == "cuda"
    common = dict(mixed_precision=recipe.training.mixed_precision, log_with=list(recipe.output.trackers) or None,
                  project_config=ProjectConfiguration(project_dir=project_dir,
                                                      logging_dir=str(tensorboard_dir(project_dir))),
                  step_scheduler_with_optimizer=False,
                  dataloader_config=DataLoaderConfiguration(
                      non_blocking=host_transfer("cuda" if on_gpu else "cpu")["non_blocking"]))
    # The processes first wait for each other (and for rank 0's data preparation) up to startup_timeout_s;
    # the loop then tightens the limit to timeout_s (see collective_timeout).
    startup = timedelta(seconds=recipe.distributed.startup_timeout_s)
    build = _ENGINES.get(layout.strategy)
    if build is None:
        raise RecipeError(f"distributed.strategy: unknown strategy {layout.strategy}")
    accelerator = Accelerator(**common, **build(recipe, startup, on_gpu))
    # accelerate has no pipeline of its own: the stage count is kept beside it, for the helpers below
    accelerator.workbench_pipeline_stages = accelerator.num_processes if layout.pipelines else 1
    return accelerator


# -- each strategy's Accelerator arguments: one builder per strategy word (strategies.py holds the layouts) ------


def _single(recipe: Recipe, startup: timedelta, on_gpu: bool) -> dict:
    return {}


def _ddp(recipe: Recipe, startup: timedelta, on_gpu: bool) -> dict:
    from accelerate.utils import InitProcessGroupKwargs

    return {"cpu": not on_gpu, "kwargs_handlers": [InitProcessGroupKwargs(timeout=startup)]}


def _deepspeed(recipe: Recipe, startup: timedelta, on_gpu: bool) -> dict:
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    # On a CPU, DeepSpeed needs gloo named explicitly and must NOT get cpu=True (it would silently become plain DDP).
    handlers = [InitProcessGroupKwargs(timeout=startup, **({} if on_gpu else {"backend": "gloo"}))]
    return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=deepspeed_config(recipe)), "kwargs_handlers": handlers}


def _fsdp(recipe: Recipe, startup: timedelta, on_gpu: bool) -> dict:
    from accelerate.utils import InitProcessGroupKwargs

    if not on_gpu:
        _fsdp_on_cpu(startup)
    return {"fsdp_plugin": fsdp_plugin(recipe), "parallelism_config": hybrid_shard_config(recipe),
            "kwargs_handlers": [InitProcessGroupKwargs(timeout=startup)]}


def _tp(recipe: Recipe, startup: timedelta, on_gpu: bool) -> dict:
    """Tensor parallel over every process: accelerate's ParallelismConfig (its device mesh), the model split by
    transformers' tp_plan as it loads (model/loading.py), peft's LoRA factors placed with their base slices."""
    from accelerate import ParallelismConfig
    from accelerate.utils import InitProcessGroupKwargs

    if not on_gpu:
        _fsdp_on_cpu(startup)  # accelerate's parallelism config needs a multi-device state, as FSDP2 does
    return {"parallelism_config": ParallelismConfig(tp_size=world_size_from_env()),
            "kwargs_handlers": [InitProcessGroupKwargs(timeout=startup)]}


# pipeline parallel: DDP's process group and device (gloo on a CPU); the model is never wrapped (accelerate has no
# pipeline: torch.distributed.pipelining runs it, workbench/distributed/pipeline.py)
_ENGINES = {"single": _single, "ddp": _ddp, "deepspeed": _deepspeed, "fsdp": _fsdp, "tp": _tp, "pp": _ddp}


def host_transfer(device_type: str) -> dict:
    """How batches reach the device: from page-locked memory without waiting, on a GPU; plainly elsewhere."""
    on_gpu = device_type == "cuda"
    return {"pin_memory": on_gpu, "non_blocking": on_gpu}


def collective_timeout(seconds: float) -> None:
    """From here on a collective that waits longer than `seconds` for another process raises.

    torch sets the limit when the process group opens; the loop wants a shorter one than startup
    (where rank 0 may prepare data for minutes while the others wait). torch has no public setter."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=seconds))


@contextmanager
def patience(seconds: float, then: float):
    """A longer limit while one rank works alone and the others wait (rank 0 writing a checkpoint)."""
    collective_timeout(seconds)
    try:
        yield
    finally:
        collective_timeout(then)


def unwrap(accelerator, model, keep_fp32_wrapper: bool = True):
    """accelerator.unwrap_model, without importing DeepSpeed into a run that does not use it.

    Accelerate imports DeepSpeed wherever it is installed, to test for its engine: 1-5 s and ~130 MiB in every
    process (most of it trackers that DeepSpeed's autotuner imports). A model can be a DeepSpeed engine only once
    DeepSpeed is imported; until then the one container to peel is torch's DDP (FSDP2 shards in place)."""
    from accelerate.utils import is_compiled_module

    if "deepspeed" in sys.modules or is_compiled_module(model):  # torch.compile's wrapper: accelerate's own way
        return accelerator.unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    if not keep_fp32_wrapper:  # the mixed-precision forward that prepare() installed, as Accelerate removes it
        original = model.__dict__.pop("_original_forward", None)
        if original is not None:
            forward = model.forward
            while hasattr(forward, "__wrapped__") and forward != original:
                forward = forward.__wrapped__
            model.forward = original if forward == original else MethodType(forward, model)
    return model


def full_state_dict(accelerator, model) -> dict:
    """accelerator.get_state_dict (whole weights on the main process); a model no engine shards holds them itself,
    and asking Accelerate would import DeepSpeed (see `unwrap`). Tensor-parallel slices are gathered whole on every
    process, a pipeline's trainable tensors from every stage on the main process (every process calls this)."""
    if pipeline_stages(accelerator) > 1:  # (the frozen base is not gathered: the adapter is saved from this)
        return gather_on_main(accelerator, {name: p for name, p in model.named_parameters() if p.requires_grad}) or {}
    if batch_replicas(accelerator) > 1:
        return whole_tensors(unwrap(accelerator, model).state_dict())
    if "deepspeed" in sys.modules or accelerator.is_fsdp2:
        return accelerator.get_state_dict(model)
    return unwrap(accelerator, model).state_dict()


def clip_gradients(accelerator, model, max_norm: float) -> torch.Tensor:
    """accelerator.clip_grad_norm_, whose torch norm cannot mix a tensor-parallel model's DTensor slices with its
    whole (replicated) tensors: there the norm is summed from each gradient's own (a slice's gathered from its
    pieces), and each gradient scaled as torch scales it (max_norm / (norm + 1e-6), at most 1). A pipeline's
    stages hold different parameters: their squared norms are summed over the stages."""
    if batch_replicas(accelerator) == 1:
        return accelerator.clip_grad_norm_(model.parameters(), max_norm)
    from torch.distributed.tensor import DTensor

    accelerator.unscale_gradients()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = [(g.norm(2).full_tensor() if isinstance(g, DTensor) else g.norm(2)).double() ** 2 for g in grads]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if pipeline_stages(accelerator) > 1:
        total = accelerator.reduce(total.to(accelerator.device), reduction="sum")
    total = total.sqrt()
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return total.float()


def pipeline_stages(accelerator) -> int:
    """The pipeline's stages (strategy pp: one a process); 1 for every other layout."""
    return getattr(accelerator, "workbench_pipeline_stages", 1)


def batch_replicas(accelerator) -> int:
    """Processes that read the same batches: a tensor-parallel group computes one batch together
    (accelerate's parallelism config says how many), a pipeline's stages each compute a part of it; 1 for data
    parallel layouts."""
    if pipeline_stages(accelerator) > 1:
        return pipeline_stages(accelerator)
    config = getattr(accelerator, "parallelism_config", None)
    return int(getattr(config, "tp_size", 1) or 1) if config is not None else 1


def batch_readers(accelerator) -> tuple[int, int]:
    """(how many different batch streams a step reads, which one this process reads): the data-parallel size and
    rank, one stream per tensor-parallel group."""
    replicas = batch_replicas(accelerator)
    return accelerator.num_processes // replicas, accelerator.process_index // replicas


def sum_of_batches(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """The sum over processes of what each process's batches gave, each batch counted once (a tensor-parallel
    group's processes read the same batch and hold the same sums; a pipeline's stages hold the sums the last one
    broadcast)."""
    total = accelerator.reduce(tensor, reduction="sum")
    replicas = batch_replicas(accelerator)
    return total / replicas if replicas > 1 else total


def accumulation_boundary(accelerator, model, last: bool):
    """The context for one micro-batch's backward: gradients are synchronised on the last of a step only.

    DeepSpeed reads the boundary from accelerate's gradient state (its engine then reduces and steps);
    DDP and FSDP skip the all-reduce through no_sync. Accelerate's public `accumulate()` counts
    micro-batches itself and scales the loss; the loop normalises over the whole step's target tokens
    instead, so it sets the boundary directly, here and nowhere else."""
    accelerator.gradient_state._set_sync_gradients(last)
    return nullcontext() if last else accelerator.no_sync(model)


def deepspeed_config(recipe: Recipe) -> dict:
    """The DeepSpeed JSON, generated from the recipe (or the user's file with our batch settings)."""
    ds = recipe.distributed.deepspeed
    training = recipe.training
    if ds.config_file:
        config = _user_deepspeed_config(ds.config_file)
    else:
        # bucket sizes from the model's width (accelerate fills `auto` as the Trainer does): DeepSpeed's own
        # defaults hold 5e8 elements of gradients in one buffer, a gigabyte in 16 bits whatever the model
        zero: dict = {"stage": ds.stage, "overlap_comm": False, "contiguous_gradients": True,
                      "reduce_bucket_size": "auto"}
        if ds.offload_optimizer == "cpu":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": local_kind() == "cuda"}
        if ds.offload_params == "cpu":
            zero["offload_param"] = {"device": "cpu", "pin_memory": local_kind() == "cuda"}
        if ds.stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = ds.save_16bit_model
            zero["stage3_prefetch_bucket_size"] = zero["stage3_param_persistence_threshold"] = "auto"
        config = {"zero_optimization": zero, "zero_allow_untested_optimizer": True,
                  "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "wall_clock_breakdown": False}
        config["bf16"] = {"enabled": training.mixed_precision == "bf16"}
        config["fp16"] = {"enabled": training.mixed_precision == "fp16"}
        config["gradient_clipping"] = training.max_grad_norm or 0.0
    # The loop marks accumulation boundaries itself (and normalises the loss over the whole step),
    # so DeepSpeed must neither count micro-batches nor divide the loss by them.
    for key, value in (("train_micro_batch_size_per_gpu", training.micro_batch_size),
                       ("gradient_accumulation_steps", 1)):
        if config.get(key, "auto") not in ("auto", value):
            raise RecipeError(f"distributed.deepspeed.config_file: {key} is {config[key]}, but the recipe "
                              f"needs {value} (set batch sizes in the recipe's training section)")
        config[key] = value
    config.pop("train_batch_size", None)
    return config


def _user_deepspeed_config(path) -> dict:
    """The user's DeepSpeed JSON; under ZeRO-3 it always gathers the 16-bit weights the adapter is saved from (the
    reader has refused a file that turns that off)."""
    file = read_deepspeed_file(path)
    if file.zero.stage != 3:
        return file.config
    zero = {key: value for key, value in file.config["zero_optimization"].items() if key not in GATHER_KEYS}
    return {**file.config, "zero_optimization": {**zero, GATHER_KEYS[0]: True}}


def fsdp_plugin(recipe: Recipe):
    from accelerate.utils import FullyShardedDataParallelPlugin

    f = recipe.distributed.fsdp
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=f.reshard_after_forward,
        cpu_offload=f.cpu_offload,
        auto_wrap_policy="transformer_based_wrap",
        state_dict_type="SHARDED_STATE_DICT" if f.state_dict == "sharded" else "FULL_STATE_DICT",
        activation_checkpointing=f.activation_checkpointing,
        cpu_ram_efficient_loading=f.cpu_ram_efficient_loading,
    )


def hybrid_shard_config(recipe: Recipe):
    """FSDP2 hybrid shard (HSDP): shard within a machine, replicate across machines. None: full shard."""
    if recipe.distributed.fsdp.sharding != "hybrid":
        return None
    from accelerate import ParallelismConfig

    per_node, nodes = processes_per_node(), node_count()
    if nodes == 1 or per_node == 1:
        raise RecipeError(
            f"distributed.fsdp.sharding: hybrid needs several machines with several processes each "
            f"(this launch: {nodes} machine(s) x {per_node} process(es)); use sharding: full"
        )
    return ParallelismConfig(dp_replicate_size=nodes, dp_shard_size=per_node)


def _fsdp_on_cpu(timeout: timedelta) -> None:
    """Let Accelerate drive FSDP2 over gloo on a CPU.

    Accelerate only chooses FSDP on an accelerator-type distributed setup and refuses it on a CPU
    (with cpu=True it silently becomes DDP). PyTorch's FSDP2 itself runs on a CPU device mesh over
    gloo, so: open the process group on gloo first, then label Accelerate's shared state as a
    multi-device run whose device is the CPU. This touches Accelerate's private state and nothing
    else; tests/test_distributed.py checks that the parameters really end up sharded.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="gloo", timeout=timeout)
    state = PartialState()
    if state.distributed_type != DistributedType.MULTI_GPU:
        state.distributed_type = DistributedType.MULTI_GPU
        state.backend = "gloo"
        state.num_processes = torch.distributed.get_world_size()
        state.process_index = torch.distributed.get_rank()
        state.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))
        state.device = torch.device("cpu")


def verify_launch(accelerator, layout: Layout) -> None:
    """Fail loudly when the processes that came up are not the run that was asked for."""
    check_process_count()
    expected_world = world_size_from_env()
    if accelerator.num_processes != expected_world:
        raise WorkbenchError(
            f"the launcher started {expected_world} processes but they do not form one run "
            f"(accelerate sees {accelerator.num_processes}); launch with `workbench launch`"
        )
    got = str(accelerator.distributed_type).split(".")[-1]
    if got not in layout.distributed_types:
        raise WorkbenchError(
            f"distributed.strategy is {layout.strategy} ({layout.name}), but accelerate came up as {got}: a silent "
            "fallback; launch with `workbench launch`, which picks a route that works on this machine"
        )


def local_parameter_elements(model) -> int:
    """Parameter elements this rank actually holds (shards under FSDP2 and ZeRO-3)."""
    total = 0
    for param in model.parameters():
        if hasattr(param, "to_local"):  # FSDP2 DTensor shard
            total += param.to_local().numel()
        elif hasattr(param, "ds_tensor"):  # ZeRO-3 partition
            total += param.ds_tensor.numel()
        else:
            total += param.numel()
    return total


def configure_threads(requested: int | None) -> tuple[int, str]:
    """CPU threads per process, and why: the recipe's number, else OMP_NUM_THREADS (what torch and every
    HPC launcher honour), else this process's share of the cores it may use (affinity and CPU quota)."""
    if requested is not None:
        why = "training.threads"
    elif os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        requested, why = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        cores, where = available_cpus()  # the cgroup's quota where a container has one
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        requested = max(1, cores // local)
        why = f"{where} / {local} local process{'es' if local > 1 else ''}"
    torch.set_num_threads(requested)
    return requested, why


class Heartbeat:
    """Each process's last finished step and its pid, kept in the launch's key-value store (the launcher hosts
    it, so it outlives a dead process): when a collective fails, the survivors can name who stopped answering."""

    def __init__(self, accelerator):
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.store = _launch_store() if self.world > 1 else None
        self.host = socket.gethostname()
        self.in_loop = False  # set once the loop starts: the limit in force is then distributed.timeout_s
        if self.store is not None:  # written afresh by every run: a second run in the process reads no stale step
            self.store.set(f"workbench/pid/{self.rank}", f"{self.host} {os.getpid()}")
            self.store.set(f"workbench/step/{self.rank}", "0")

    def beat(self, step: int) -> None:
        if self.store is not None:
            self.store.set(f"workbench/step/{self.rank}", str(step))

    def _get(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode() if self.store is not None and self.store.check([key]) else None
        except Exception:  # noqa: BLE001  the store's host is gone too
            return None

    def others(self, step: int) -> str:
        """Which other ranks are gone (a process of this machine that no longer exists) or behind `step`."""
        gone, behind = [], []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            host, _, pid = (self._get(f"workbench/pid/{rank}") or "").partition(" ")
            if host == self.host and pid.isdigit() and not process_alive(int(pid)):
                gone.append(f"rank {rank} (pid {pid}) exited")
                continue
            done = self._get(f"workbench/step/{rank}")
            if done is not None and int(done) < step:
                behind.append(f"rank {rank} stopped answering after step {done}")
        return "; ".join(gone + behind) or "another rank failed or stalls"


def collective_failure(err: BaseException, heartbeat: Heartbeat, step: int, limits: tuple[float, float],
                       checkpoint: str | None) -> WorkbenchError | None:
    """A collective that failed (a peer died) or outwaited its limit, as one error naming this rank, the step and
    the other ranks' state; None when `err` did not come out of a collective.
    limits: (startup_timeout_s, timeout_s); checkpoint: the last complete one's name, if any."""
    if heartbeat.world < 2 or not isinstance(err, RuntimeError) or not _raised_in_collective(err):
        return None
    limit = (f"distributed.timeout_s={limits[1]:g} s" if heartbeat.in_loop
             else f"distributed.startup_timeout_s={limits[0]:g} s")
    first_line = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    then = (f"The last complete checkpoint, {checkpoint}, stays usable: run the same command with --resume"
            if checkpoint else "No checkpoint was complete yet")
    when = f"after step {step}" if step else "before the first step"
    return WorkbenchError(
        f"rank {heartbeat.rank} of {heartbeat.world}: a collective {when} failed or waited longer than {limit}: "
        f"{heartbeat.others(step)} ({first_line}). {then}")


def _raised_in_collective(err: BaseException) -> bool:
    """Whether the error came out of torch.distributed (or DeepSpeed's comm layer over it): its traceback runs
    through their code. A RuntimeError that merely mentions a timeout elsewhere is left alone."""
    if isinstance(err, getattr(torch.distributed, "DistError", ())):
        return True
    frame = err.__traceback__
    while frame is not None:
        name = frame.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name or "/deepspeed/comm/" in name:
            return True
        frame = frame.tb_next
    return False


def _launch_store():
    """torch's store for this process group (the launcher's TCPStore), with a short timeout of its own."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        store.set_timeout(timedelta(seconds=5))
        return store
    except Exception:  # noqa: BLE001  no store: the error still names this rank and the step
        return None

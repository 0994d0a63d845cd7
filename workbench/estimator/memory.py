"""Know before you run: the memory, speed and cost of a recipe, per device, for every sharding strategy.

    est = estimate(Recipe.load("recipes/x.yaml"), world_size=8, device="h100")
    print(est.to_text()); est.to_json(); est.to_dataframe()

Every term is in bytes and explained, with its formula and the measurements behind the constants,
in docs/estimator.md. The model is built on the meta device, so parameter counts are exact.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from workbench.base.errors import RecipeError
from workbench.base.heap import LARGE_BLOCK, large_blocks_returned
from workbench.base.units import format_bytes
from workbench.estimator.calibration import spread_of
from workbench.hardware.catalogue import Device, get_device
from workbench.hardware.current import node_count
from workbench.hardware.precision import compute_dtype_of, frozen_dtype_of, resolve_recipe, vocabulary_dtype
from workbench.hardware.probes import cpu_decomposition_rate, cpu_runtime_bytes
from workbench.model.attention import dense_mask_warning, mask_bytes
from workbench.model.attention import resolve as resolve_attention
from workbench.model.attention import with_implementation as attention_for
from workbench.spec import adapter_init, batch_split
from workbench.spec.adapter_init import startup_cost
from workbench.spec.formats import format_of
from workbench.spec.model_configs import ModelInfo, chunked_loss, describe_model, lora_targets, named_in
from workbench.spec.recipe import Recipe
from workbench.spec.rope_scaling import context_length
from workbench.spec.strategies import FSDP, PARTS, PP, Layout, candidates, layout_problem, mesh_text

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CUDA_CONTEXT = 500 * 2**20  # CUDA context + cuBLAS/cuDNN workspaces, outside PyTorch's allocator
ZERO3_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's stage3_max_live_parameters default
CUDA_HOST_LIBRARIES = 2 * 2**30  # what a CUDA process's host memory holds of its libraries (1-3 GB as measured)
CPU_HEAP_GROWTH = 1.5  # RSS grows by this much per byte of live per-step tensors on CPU (glibc heap: 1.3 measured
# when the tokenized data is cached, 1.7 when the run tokenizes first)
# Blocks the heap maps on its own (workbench/base/heap.py) go back to the system when freed: no growth for those
# (bench:llama3-1b, 1 x 512 tokens, float32, 1 MiB threshold: LoRA, QLoRA and checkpointing within 2%).
TOKENIZER_BYTES_PER_ENTRY = 1200  # RSS of a loaded fast tokenizer per vocabulary entry (measured)
CHARS_PER_TOKEN = 4  # token count of a data file, approximated from its text
QUANT_BLOCK = 64  # bitsandbytes 4-bit: one absmax per 64 weights
OPTIM_8BIT_MIN = 4096  # bitsandbytes keeps 32-bit states for tensors smaller than this
GiB = 2**30


@dataclass
class Estimate:
    model: dict
    device: dict
    strategies: list[dict]
    recommended: str
    throughput: dict
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # the single-device terms the breakdowns are built from
    terms: dict = field(default_factory=dict, repr=False)  # the same, in full: any layout's row is built from them
    # each row's "limits" (largest micro-batch, longest sequence that fit) hold the other setting at these values
    limits_at: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"model": self.model, "strategies": self.strategies, "recommended": self.recommended,
                "throughput": self.throughput, "notes": self.notes, "device": self.device, "details": self.details,
                "limits_at": self.limits_at}

    def to_dataframe(self):
        import pandas as pd

        rows = [{"strategy": s["name"], "per_device_bytes": s["per_device_bytes"], "cpu_bytes": s["cpu_bytes"],
                 "fits": s["fits"], **s["breakdown"], "max_micro_batch_size": s["limits"]["micro_batch_size"],
                 "max_seq_len": s["limits"]["max_seq_len"]} for s in self.strategies]
        return pd.DataFrame(rows).set_index("strategy")

    def plot(self):
        """Stacked memory per device of each strategy against the device's memory: a matplotlib Figure."""
        from workbench.base.charts import memory_breakdown

        d = self.device
        return memory_breakdown(self.strategies, self.recommended, d["memory_bytes"], f"{d['name']} memory")

    def _repr_html_(self) -> str:
        import html

        frame = self.to_dataframe()
        gib = frame.drop(columns=["fits"]).map(lambda v: f"{v / 2**30:.2f} GiB")
        gib.insert(1, "fits", frame["fits"].map({True: "yes", False: "no"}))
        d, t = self.device, self.throughput
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (f"<div><b>{html.escape(self.model['name'])}</b> on {d['count']} × {html.escape(d['name'])}: "
                f"recommended <b>{html.escape(self.recommended)}</b>, ~{t['tokens_per_s']:,.0f} tokens/s"
                f"{gib.to_html()}<ul>{notes}</ul></div>")

    def to_text(self, width: int = 120) -> str:
        from rich.console import Console
        from rich.table import Table

        d = self.device
        table = Table(title=f"{self.model['name']} on {d['count']} × {d['name']} "
                            f"({format_bytes(d['memory_bytes'])} each)")
        for col in ("strategy", "per device", "fits", "weights", "adapter", "grads", "optim", "activ.", "other",
                    "CPU RAM/node", "max batch", "max len"):
            table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=col == "strategy")
        for s in self.strategies:
            b = s["breakdown"]
            mark = "*" if s["name"] == self.recommended else ""
            # its device mesh on the line below the name (the table is as wide as a terminal already)
            table.add_row(f"{s['name']}{mark}\n{mesh_text(s.get('mesh') or {}, short=True)}",
                          format_bytes(s["per_device_bytes"]),
                          "refused" if s.get("refused") else "yes" if s["fits"] else "no",
                          *(format_bytes(b[k]) for k in ("weights", "adapter", "gradients", "optimizer", "activations",
                                                  "other")), format_bytes(s["cpu_bytes"]),
                          _limit(s.get("limits", {}).get("micro_batch_size"), MAX_MICRO_BATCH),
                          _limit(s.get("limits", {}).get("max_seq_len"), MAX_SEQ_LEN))
        console = Console(width=width, record=True, file=open(os.devnull, "w"))
        m, t = self.model, self.throughput
        console.print(f"params {m['params']:,}  trainable {m['trainable_params']:,}")
        console.print(table)
        console.print(f"recommended: {self.recommended}" + ("  (* in the table)" if self.recommended != "none" else ""))
        console.print(f"max batch: the largest training.micro_batch_size that fits at data.max_seq_len="
                      f"{self.limits_at.get('max_seq_len')}; max len: the longest data.max_seq_len at "
                      f"training.micro_batch_size={self.limits_at.get('micro_batch_size')}")
        chosen = next((s for s in self.strategies if s["name"] == self.recommended), self.strategies[0])
        spread, cautious = chosen.get("spread"), chosen.get("limits_cautious") or {}
        if spread:
            low, high = chosen["per_device_range"]
            console.print(f"spread: measured peaks of {chosen['name']} runs have been {spread['low']:.2f}-"
                          f"{spread['high']:.2f} x the estimate ({format_bytes(low)} to {format_bytes(high)} here; {spread['runs']}); "
                          f"at the high end, max batch {_limit(cautious.get('micro_batch_size'), MAX_MICRO_BATCH)}, "
                          f"max len {_limit(cautious.get('max_seq_len'), MAX_SEQ_LEN)}")
        line = f"throughput: ~{t['tokens_per_s']:,.0f} tokens/s on {d['count']} device(s) (MFU {t['mfu']})"
        if t.get("epoch_tokens"):
            line += (f"; epoch of ~{t['epoch_tokens']:,} tokens: {t['epoch_hours']:.2f} h, "
                     f"{t['gpu_hours']:.2f} device-hours")
            if t.get("cost") is not None:
                line += f", ~{t['cost']:.2f} at {t['price_per_gpu_hour']}/device-hour"
        console.print(line)
        for note in self.notes:
            console.print(f"- {note}")
        for s in self.strategies:
            if s.get("refused"):
                console.print(f"- {s['name']} refused: {s['refused']}")
        return console.export_text()


def estimate(recipe: Recipe, world_size: int = 1, nodes: int = 1, device: str | None = None,
             device_memory: int | str | None = None, price_per_gpu_hour: float | None = None) -> Estimate:
    """Memory per device for each strategy, the recommended one, and predicted throughput and cost."""
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise RecipeError(f"world_size ({world_size}) must be a positive multiple of nodes ({nodes})")
    batch_size = recipe.training.batch_size if recipe.training.micro_batch_auto else None
    if batch_size:  # the table at one sequence; each layout's row says the split it would take
        recipe = batch_split.provisional(recipe)
    recipe, precision, info, attention, dev = _as_run_there(recipe, device, device_memory)
    terms = single_device_terms(recipe, info, dev)
    # a pipeline is never chosen by `auto`: its row is shown beside the candidates, last
    layouts = candidates(world_size, nodes) + ([PP] if world_size > 1 else [])
    strategies = [_strategy(layout, terms, dev, world_size, nodes) for layout in layouts]
    for row, limits, layout in zip(strategies, fit_limits(recipe, info, dev, world_size, nodes, layouts), layouts):
        row["limits"] = limits
        row["refused"] = layout_problem(recipe, layout)  # a layout the recipe cannot run, whatever its memory
        # what measured runs of this kind of layout have been against the estimate (estimator/calibration.py)
        spread = spread_of(layout, dev.kind)
        row["spread"] = spread.to_json()
        row["per_device_range"] = [int(row["per_device_bytes"] * spread.low), int(row["per_device_bytes"] * spread.high)]
        # the planner's limits where this run lands as high as the highest measured one did
        cautious = replace(dev, memory=int(dev.memory / max(spread.high, 1.0)))
        row["limits_cautious"] = fit_limits(recipe, info, cautious, world_size, nodes, [layout])[0]
        if batch_size:
            micro = batch_split.largest_within(batch_size, row["limits_cautious"]["micro_batch_size"])
            row["micro_batch_split"] = [micro, batch_size // micro]
    recommended = next((s["name"] for s in strategies if s["fits"] and not s["refused"]), "none")
    model = {"name": recipe.model.path, "source": info.source, "params": info.params,
             "trainable_params": terms["trainable_params"],
             "total_params": info.params + (terms["trainable_params"] if recipe.adapter.method != "full" else 0)}
    device_json = {**dev.to_json(), "count": world_size, "nodes": nodes}
    throughput = _throughput(recipe, info, dev, world_size, price_per_gpu_hour)
    notes = [*precision.warnings, *filter(None, [dense_mask_warning(attention, dev.kind)]),
             *_notes(strategies, recommended, dev, world_size, terms, recipe)]
    notes += _splitting_notes(strategies, recommended, dev, world_size, terms, recipe)
    device_json["precision"] = precision.to_json()
    device_json["attention"] = attention.to_json()
    details = {k: v for k, v in terms.items() if k != "trainable_numels"}
    if batch_size:
        notes.append(f"training.micro_batch_size auto: the table holds one sequence per micro-batch; the split of "
                     f"training.batch_size={batch_size} each layout would take (the largest whose estimate fits at "
                     "the high end of its measured range): " + ", ".join(
                         f"{s['name']} {s['micro_batch_split'][0]} x {s['micro_batch_split'][1]}" for s in strategies))
    limits_at = {"micro_batch_size": recipe.training.micro_batch_size, "max_seq_len": recipe.data.max_seq_len}
    return Estimate(model, device_json, strategies, recommended, throughput, notes, details, terms, limits_at)


def _as_run_there(recipe: Recipe, device: str | None, device_memory: int | str | None):
    """The recipe as a run on that device would resolve it (precision, attention kernel), with what describes
    them: (recipe, precision, model info, attention, device)."""
    dev = get_device(device, device_memory if device_memory is not None else recipe.distributed.device_memory)
    # the same `auto` precision a run on that device would resolve (workbench/hardware/precision.py)
    recipe, precision = resolve_recipe(recipe, dev.kind, dev.bf16 if dev.kind == "cuda" else None)
    info = describe_model(recipe.model.path, recipe.model.revision, recipe.model.trust_remote_code)
    recipe, attention = attention_for(recipe, dev.kind, here=False,  # the kernel a run there uses
                                      flex_problem=None if info.flex_attention else "no FlexAttention for this model")
    return recipe, precision, info, attention, dev


def micro_batch_limit(recipe: Recipe, layout: Layout, world_size: int, nodes: int = 1, *, end: str = "high",
                      device_memory: int | str | None = None) -> int:
    """The largest training.micro_batch_size whose estimate on `layout` fits this machine's device where the run
    lands at that `end` ("high" or "low") of the layout's measured spread (0: not even one sequence)."""
    recipe, _, info, _, dev = _as_run_there(recipe, None, device_memory)
    spread = spread_of(layout, dev.kind)
    scaled = replace(dev, memory=int(dev.memory / (max(spread.high, 1.0) if end == "high" else spread.low)))
    return fit_limits(recipe, info, scaled, world_size, nodes, [layout])[0]["micro_batch_size"]


def layout_estimate(recipe: Recipe, layout: Layout, world_size: int, device_type: str,
                    device_memory: int | None = None) -> dict:
    """The estimate's row for one layout on this kind of device: per_device_bytes, cpu_bytes, breakdown."""
    est = estimate(recipe, world_size=world_size, device="cpu" if device_type == "cpu" else None,
                   device_memory=device_memory)
    dev = get_device("cpu" if device_type == "cpu" else None, device_memory)
    return _strategy(layout, est.terms, dev, world_size, node_count())


def prediction_for_run(recipe: Recipe, layout: Layout, world_size: int, device_type: str) -> dict:
    """The estimate for a run's own layout, for its run.json summary beside what it measures.

    On CUDA the run measures max_memory_allocated, which leaves out the CUDA context: so does this.
    Never raises: a run must not fail because its prediction did.
    """
    try:
        est = estimate(recipe, world_size=world_size, device="cpu" if device_type == "cpu" else None)
        dev = get_device("cpu" if device_type == "cpu" else None)
        row = _strategy(layout, est.terms, dev, world_size, node_count())
        peak = row["per_device_bytes"] - (CUDA_CONTEXT if device_type == "cuda" else 0)
        return {"predicted_peak_memory_mb": round(peak / 2**20, 1), "predicted_strategy": row["name"],
                "predicted_tokens_per_s": round(est.throughput["tokens_per_s"], 1)}
    except Exception as err:  # noqa: BLE001
        return {"prediction_error": f"{type(err).__name__}: {err}"}


# -- the planner: what fits -------------------------------------------------------------------------

MAX_MICRO_BATCH, MAX_SEQ_LEN = 4096, 2**20  # the search stops here ("at least")
MIN_SEQ_LEN = 8  # the recipe's own lower bound for data.max_seq_len


def fit_limits(recipe: Recipe, info: ModelInfo, dev: Device, world_size: int, nodes: int,
               layouts: list[Layout]) -> list[dict]:
    """For each layout: the largest training.micro_batch_size (at the recipe's data.max_seq_len) and the longest
    data.max_seq_len (at its micro_batch_size, and within the model's context) whose estimate fits the device;
    0 where not even the smallest does.
    The same terms as the table, recomputed for each size tried (a doubling, then a bisection)."""
    cache: dict = {}
    # the sizes tried are micro-batches on their own: a training.batch_size (micro x accumulation) would refuse them
    recipe = recipe.override(training__batch_size=None) if recipe.training.batch_size is not None else recipe
    # no longer than the model's positions reach (stretched by model.rope_scaling)
    context = min(context_length(recipe.model, info.context) or MAX_SEQ_LEN, MAX_SEQ_LEN)

    def terms_for(key: str, value: int) -> dict:
        if (key, value) not in cache:
            cache[key, value] = single_device_terms(recipe.override(**{key: value}), info, dev)
        return cache[key, value]

    def largest(layout: Layout, key: str, floor: int, cap: int) -> int:
        def fits(value: int) -> bool:
            return _strategy(layout, terms_for(key, value), dev, world_size, nodes)["fits"]

        if not fits(floor):
            return 0
        low, high = floor, floor * 2
        while high <= cap and fits(high):
            low, high = high, high * 2
        if high > cap:
            return cap if fits(cap) else _bisect(fits, low, cap)
        return _bisect(fits, low, high)

    # (an objective that samples answers holds micro_batch_size x num_generations sequences, capped by the recipe)
    most_prompts = MAX_MICRO_BATCH // (recipe.training.grpo.num_generations
                                       if recipe.training.objective_spec.samples_answers else 1)
    return [{"micro_batch_size": largest(layout, "training__micro_batch_size", 1, most_prompts),
             "max_seq_len": largest(layout, "data__max_seq_len", MIN_SEQ_LEN, context)} for layout in layouts]


def _bisect(fits, low: int, high: int) -> int:
    """The largest value in [low, high) that fits, given that low fits and high does not."""
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _limit(value: int | None, cap: int) -> str:
    """A planner figure; "+" where the search stopped at its cap rather than at the device's memory."""
    if value is None:
        return "-"
    return f"{value:,}+" if value == cap else f"{value:,}"


# -- the terms of one training process on one device ------------------------------------------------


def single_device_terms(recipe: Recipe, info: ModelInfo, dev: Device) -> dict:
    """Bytes of every term for one process holding the whole model (the `single` strategy)."""
    method, train = recipe.adapter.method, recipe.training
    model_bytes = DTYPE_BYTES[recipe.model.dtype]
    targets = lora_targets(recipe, info)
    if method == "full":
        numels = [lin.in_features * lin.out_features for lin in info.linears]
        numels += [info.params - sum(numels)]  # embeddings, norms, biases: one lump is close enough
        trainable, train_bytes, adapter = info.params, model_bytes, 0
    else:
        numels = [recipe.adapter.r * lin.in_features for lin in targets]
        numels += [recipe.adapter.r * lin.out_features for lin in targets]
        if method == "dora":
            numels += [lin.out_features for lin in targets]  # the magnitude vector
        # modules_to_save: a trained copy of each named module (counted like adapter weights, fp32)
        numels += [lin.in_features * lin.out_features for lin in info.linears
                   if named_in(lin.name, recipe.adapter.modules_to_save or [])]
        if any(n in ("embed_tokens", "wte", "word_embeddings") for n in recipe.adapter.modules_to_save or []):
            numels += [info.vocab * info.hidden]
        trainable, train_bytes = sum(numels), 4  # peft keeps adapter weights in fp32
        adapter = 4 * trainable
    gradients = train_bytes * trainable
    optimizer = optimizer_bytes(numels, train_bytes, train.optimizer)
    acts = activation_bytes(recipe, info, targets, dev.kind == "cuda")
    sampling = generation_bytes(recipe, info)
    runtime = CUDA_CONTEXT if dev.kind == "cuda" else cpu_runtime_bytes() + TOKENIZER_BYTES_PER_ENTRY * info.vocab
    weights = weight_bytes(recipe, info)
    start = startup_cost(recipe, [(lin.out_features, lin.in_features) for lin in targets] if method != "full" else [])
    terms = {
        "trainable_params": trainable, "trainable_numels": numels, "weights": weights, "adapter": adapter,
        # (sampling answers, grpo: its KV cache peaks before the step's activations, not beside them)
        "gradients": gradients, "optimizer": optimizer, "activations": max(acts["saved"] + acts["loss"], sampling),
        "generation_cache": sampling,
        "saved_activations": acts["saved"], "logits_and_loss": acts["loss"],
        "tp_split_saved_activations": acts["tp_split_saved"],
        "activations_full_logits": max(acts["saved"] + acts["loss_full_logits"], sampling),
        "autocast_copies": acts["autocast_copies"], "runtime": runtime, "allocator": 0, "loading": 0,
        **_gathered_bytes(recipe, info),
        "dequantized_copy": _dequantized_bytes(recipe, info, dev),
        # the checkpoint as published (what a process reads into host memory to hand out shards)
        "checkpoint_bytes": info.checkpoint_bytes or info.params * DTYPE_BYTES.get(info.checkpoint_dtype, 2),
        "master_weights": 4 * trainable if train_bytes < 4 else 0,
        # with one micro-batch per step, backward frees activations as it creates gradients (and
        # zero_grad(set_to_none) frees those): the two peak one after the other, not together
        "gradients_overlap_activations": int(train.grad_accum == 1),
        # PiSSA/OLoRA: the starting A0/B0 kept in host memory for the saved adapter's conversion, and the
        # decomposition of every target weight at start-up (adapter_init.startup_cost)
        "initial_adapter": start["kept_bytes"], "init_transient": start["transient_bytes"],
        "init_flops": start["flops"],
        **_tensor_parallel_shares(recipe, info, targets, weights),
        **_pipeline_shares(recipe, info),
    }
    if dev.kind == "cpu":
        # glibc keeps freed heap pages between steps: per-step tensors cost more RSS than their size.
        step = _step_bytes(terms, gradients) + terms["autocast_copies"]
        terms["allocator"] = int((cpu_heap_growth(recipe, info) - 1) * step)
        train_peak = sum(terms[k] for k in ("weights", "adapter", "optimizer", "autocast_copies", "runtime",
                                            "allocator")) + _step_bytes(terms, gradients)
        load_peak = runtime + weights + max(loading_transient_bytes(recipe, info, method), start["transient_bytes"])
        terms["loading"] = max(0, load_peak - train_peak)
    return terms


def loading_transient_bytes(recipe: Recipe, info: ModelInfo, method: str) -> int:
    """What loading holds beside the finished weights. A mapped checkpoint (hub models, remote code): the file's
    pages while its dtype is converted or it is quantized. Read a tensor at a time (local safetensors,
    models.read_without_mapping): the largest tensor as read, the embedding."""
    checkpoint_dtype_bytes = DTYPE_BYTES.get(info.checkpoint_dtype, 2)
    if info.read_without_mapping:
        # and a 16-bit vocabulary is loaded in the model dtype before it is cast down (prepare_quantized)
        narrowed = vocabulary_params(info) * (DTYPE_BYTES[frozen_dtype_of(recipe)] -
                                              DTYPE_BYTES[vocabulary_dtype(recipe, info)])
        read = DTYPE_BYTES.get(info.vocabulary_stored_dtype or info.checkpoint_dtype, 2)
        return info.vocab * info.hidden * read + narrowed
    checkpoint = info.checkpoint_bytes or info.params * checkpoint_dtype_bytes
    same = info.checkpoint_dtype == recipe.model.dtype and method != "qlora"
    return 0 if same else checkpoint


def cpu_heap_growth(recipe: Recipe, info: ModelInfo) -> float:
    """RSS per byte of per-step tensors. When the training process maps large blocks on its own and returns
    them when freed (workbench/base/heap.py), the share of a step's bytes in such blocks does not grow: that share
    is taken as 1 - LARGE_BLOCK / (a micro-batch's MLP activation)."""
    if not large_blocks_returned():
        return CPU_HEAP_GROWTH
    tokens = recipe.training.micro_batch_size * recipe.data.row_len
    typical = tokens * max(info.intermediate, info.hidden) * DTYPE_BYTES[frozen_dtype_of(recipe)]
    mapped = max(0.0, 1 - LARGE_BLOCK / typical)
    return 1 + (CPU_HEAP_GROWTH - 1) * (1 - mapped)


def _step_bytes(terms: dict, gradients: int) -> int:
    """Gradients plus the activations that sit on top of them at the step's peak."""
    if terms["gradients_overlap_activations"]:
        return max(terms["activations"], gradients)
    return terms["activations"] + gradients


def _gathered_bytes(recipe: Recipe, info: ModelInfo) -> dict:
    """What sharded layouts hold unsharded beside their shards, as stored (4-bit layers stay 4-bit).

    ZeRO-3 gathers one unit at a time (a decoder layer, or the embedding or head) and prefetches the next layer:
    the largest unit plus one layer, or more: what stays live (below). FSDP2 shards each decoder layer and, last, the root (embeddings, head, final
    norm), and prefetches the next layer as ZeRO-3 does; but its root is not resharded after forward (backward
    needs it at once), so the embeddings and head stay whole from the start of forward to the end of backward:
    the root plus two layers."""
    if recipe.adapter.method == "qlora":
        linear = sum(lin.in_features * lin.out_features for lin in info.linears if lin.in_layer)
        frozen = DTYPE_BYTES[frozen_dtype_of(recipe)]
        layer = _quantized_bytes(linear, recipe) + frozen * (info.layer_params - linear)
        embedding = frozen * info.vocab * info.hidden
        root = DTYPE_BYTES[vocabulary_dtype(recipe, info)] * vocabulary_params(info)
    else:
        layer = info.layer_params * DTYPE_BYTES[recipe.model.dtype]
        embedding = info.vocab * info.hidden * DTYPE_BYTES[recipe.model.dtype]
        root = vocabulary_params(info) * DTYPE_BYTES[recipe.model.dtype]
    # ZeRO-3 keeps what it gathered until stage3_max_live_parameters (1e9, its default, which the workbench keeps)
    # are live, and releases nothing it will use again within stage3_max_reuse_distance (1e9 too): a model of
    # fewer parameters stays gathered whole for the step (measured: bench/layouts_cpu.py, 0.2 GB of 135M in bf16)
    live = weight_bytes(recipe, info) * min(1.0, ZERO3_MAX_LIVE_PARAMETERS / info.params)
    return {"gathered_weights": int(max(max(layer, embedding) + layer, live)),
            "gathered_root_and_layers": int(root + 2 * layer)}


def _dequantized_bytes(recipe: Recipe, info: ModelInfo, dev: Device) -> int:
    """bitsandbytes multiplies by a 4-bit weight through a copy of it in the compute dtype (forward, and again in
    backward for the input's gradient): the largest quantized Linear, whole, at the step's peak. On a CPU the
    workbench's 4-bit path computes a block of it at a time (counted in the calibration)."""
    if recipe.adapter.method != "qlora" or dev.kind == "cpu":
        return 0
    largest = max((lin.in_features * lin.out_features for lin in info.linears if lin.in_layer), default=0)
    return largest * DTYPE_BYTES[compute_dtype_of(recipe)]


def _tensor_parallel_shares(recipe: Recipe, info: ModelInfo, targets, weights: int) -> dict:
    """What tensor parallel splits (model/tensor_parallel.py): the decoder layers' linear weights (the embeddings,
    norms and head stay whole here), and of each LoRA pair the larger factor (B of a colwise layer, A of a rowwise
    one; the other whole), their gradients and moments as their weights. Fractions of the whole."""
    # (the linears `in_layer` are the first decoder layer's; every layer holds the same)
    split = info.layers * sum(lin.in_features * lin.out_features for lin in info.linears if lin.in_layer)
    pairs = [(lin.in_features, lin.out_features) for lin in targets if lin.in_layer]
    factors = sum(i + o for i, o in pairs)
    return {"tp_split_weights": min(1.0, split * DTYPE_BYTES[recipe.model.dtype] / weights) if weights else 0.0,
            "tp_split_adapter": sum(max(i, o) for i, o in pairs) / factors if factors else 0.0}


def _pipeline_shares(recipe: Recipe, info: ModelInfo) -> dict:
    """What a pipeline stage holds (model/pipeline_stages.py): its decoder layers, the embeddings on the first
    stage, the head on the last (its own copy where tied: each stage keeps the modules it runs), as fractions of
    the whole model's parameters; and the step's micro-batches and schedule, which decide the activations in
    flight."""
    head = next((lin for lin in info.linears if lin.name == info.head), None)
    head_params = info.embedding_params if info.tied_embeddings else (
        head.in_features * head.out_features if head is not None else 0)
    whole = max(1, info.params)
    return {"pp_embedding_share": info.embedding_params / whole, "pp_head_share": head_params / whole,
            "pp_layers_share": max(0, info.params - vocabulary_params(info)) / whole, "pp_layers": info.layers,
            "pp_micro_batches": recipe.training.grad_accum,
            "pp_gpipe": int(recipe.distributed.pipeline.schedule == "gpipe"),
            # the hidden states a stage receives (and sends) per micro-batch
            "pp_boundary": recipe.training.micro_batch_size * recipe.data.row_len * info.hidden * 4}


def pipeline_stage_bytes(t: dict, stages: int) -> dict:
    """The largest stage's weights, adapter share and activations under strategy pp (first or last: the first
    takes the layers' remainder and the embeddings and keeps the most micro-batches in flight, the last the
    head and the loss). The rows of a 1F1B stage i keep at most (stages - i) micro-batches' activations (the
    first stage: as many as there are stages), a GPipe stage every one of the step's."""
    layers, m = max(1, t["pp_layers"]), max(1, t["pp_micro_batches"])
    first_layers, last_layers = -(-layers // stages), layers // stages
    in_flight_first = m if t["pp_gpipe"] else min(stages, m)
    in_flight_last = m if t["pp_gpipe"] else 1
    per_layer = t["saved_activations"] / layers
    rows = []
    for own, share, in_flight, loss in ((first_layers, t["pp_embedding_share"], in_flight_first, 0),
                                        (last_layers, t["pp_head_share"], in_flight_last, t["logits_and_loss"])):
        weight_share = own / layers * t["pp_layers_share"] + share
        activations = in_flight * (own * per_layer + loss) + m * t["pp_boundary"]
        rows.append({"weights": t["weights"] * weight_share, "layers": own / layers, "activations": activations})
    return max(rows, key=lambda row: row["weights"] + row["activations"])


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """The share of a step each stage idles while the pipeline fills and drains: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def weight_bytes(recipe: Recipe, info: ModelInfo) -> int:
    """Frozen (or, for full fine-tuning, trained) base weights as they sit in memory. A reward model loads without
    the LM head's own matrix (its score head, hidden x 1, is counted with the trainable weights)."""
    head = next((lin for lin in info.linears if lin.name == info.head), None)
    unloaded = (head.in_features * head.out_features if recipe.training.scores_sequences and head is not None
                and not info.tied_embeddings else 0)
    if recipe.adapter.method != "qlora":
        return (info.params - unloaded) * DTYPE_BYTES[recipe.model.dtype]
    quantized = sum(lin.in_features * lin.out_features for lin in info.linears if lin.name != info.head)
    # the rest (embeddings, head, norms) in the model dtype, or float32 with quantization.upcast_frozen;
    # the vocabulary 16-bit as published where the model computes in float32 (precision.vocabulary_dtype_of)
    vocabulary = vocabulary_params(info)
    return int(_quantized_bytes(quantized, recipe) + DTYPE_BYTES[frozen_dtype_of(recipe)] *
               (info.params - quantized - vocabulary) + DTYPE_BYTES[vocabulary_dtype(recipe, info)] *
               (vocabulary - unloaded))


def vocabulary_params(info: ModelInfo) -> int:
    """The input embeddings and, when it has its own matrix, the output head."""
    head = next((lin for lin in info.linears if lin.name == info.head), None)
    untied = head.in_features * head.out_features if head is not None and not info.tied_embeddings else 0
    return info.embedding_params + untied


def _quantized_bytes(n: int, recipe: Recipe) -> float:
    """bitsandbytes storage of n Linear weights: 8-bit plus an fp32 scale per row (about 1/1000),
    or 4-bit plus one absmax per 64 weights: fp32, or with double quant 8-bit + fp32 per 256 blocks."""
    q = recipe.quantization
    if q.bits == 8:
        return n * (1 + 4 / 1024)
    blocks = n / QUANT_BLOCK
    return n / 2 + (blocks * (1 + 4 / 256) if q.double_quant else blocks * 4)


def optimizer_bytes(numels: list[int], param_bytes: int, optimizer: str) -> int:
    """AdamW: two states per parameter in the parameter's dtype; 8-bit: one byte each + block scales."""
    if optimizer == "adamw":
        return 2 * param_bytes * sum(numels)
    total = 0
    for n in numels:
        total += 2 * n + 2 * 4 * math.ceil(n / 256) if n >= OPTIM_8BIT_MIN else 8 * n
    return total


def activation_bytes(recipe: Recipe, info: ModelInfo, targets: list, on_gpu: bool) -> dict:
    """What autograd keeps for backward per micro-batch, the loss buffers, and autocast's weight copies.

    Per token and decoder layer, each tensor in the dtype it really has (checked against autograd's
    saved tensors in docs/estimator.md): frozen Linears keep nothing, trainable ones keep their input.
    """
    train, method, adapter = recipe.training, recipe.adapter.method, recipe.adapter
    tokens = micro_batch_tokens(recipe)
    autocast = train.mixed_precision in ("bf16", "fp16")
    resid = DTYPE_BYTES[frozen_dtype_of(recipe)]  # the embeddings' dtype: float32 when QLoRA upcasts them
    a = 2 if autocast else resid  # attention and LoRA tensors
    mlp = resid if method == "qlora" else a  # bitsandbytes returns its input's dtype, outside autocast
    lora = a if autocast else 4  # peft computes the adapter in fp32 unless autocast says otherwise
    h, q, kv = info.hidden, info.heads * info.head_dim, info.kv_heads * info.head_dim
    layer = 0.0
    for name, width in info.layer_norms:  # RMSNorm keeps an fp32 copy of its input (and rsqrt)
        rows = info.heads if "q_norm" in name else info.kv_heads if "k_norm" in name else 1
        layer += (4 * width + 4) * rows + (resid * width * rows if method == "full" else 0)  # + pre-weight
    # what tensor parallel splits by heads and by the MLP's width (each process holds its share): q, k, v, the
    # output (o_proj's input), log-sum-exp, eager attention's probabilities, the MLP's outputs, and the inputs of
    # the row-split layers; the rest (norms, the layer inputs the column-split layers read) stays whole
    split = a * (2 * q + 2 * kv) + 4 * info.heads
    if recipe.model.attn == "eager":  # softmax probabilities in fp32 and cast back: B x heads x T x T
        split += info.heads * recipe.data.max_seq_len * (4 + a)
    split += mlp * info.intermediate * (3 if info.gated_mlp else 1)  # gate, up, activation outputs
    layer += split
    in_layer = [lin for lin in targets if lin.in_layer]
    row_split = [lin for lin in in_layer if _row_split(lin)]
    if method == "full":
        layer += a * _distinct_inputs([lin for lin in info.linears if lin.in_layer])
        split += a * _distinct_inputs([lin for lin in info.linears if lin.in_layer and _row_split(lin)])
    elif fast_lora_inputs(recipe):
        # the loop's fast path: the input stays in the autocast dtype; dropout keeps its output and, on a
        # CPU, the int64 positions it dropped (p of them); without dropout the input is shared
        if adapter.dropout > 0:
            per_element = a + (1 if on_gpu else 8 * adapter.dropout)
            layer += sum(lin.in_features for lin in in_layer) * per_element
            split += sum(lin.in_features for lin in row_split) * per_element
        else:
            layer += a * _distinct_inputs(in_layer)
            split += a * _distinct_inputs(row_split)
    elif autocast or adapter.dropout > 0 or resid != 4:
        # peft casts the input to fp32 (then autocast to 16 bit) or drops it out: a copy per module;
        # dropout also keeps its mask: bool on CUDA, on a CPU a float noise tensor, or with the fast paths the
        # int64 positions it dropped (fastpath.lora_fast_paths swaps the dropout of 4/8-bit layers as well)
        sparse = train.fast_paths and method != "dora"
        mask = 0 if adapter.dropout == 0 else 1 if on_gpu else 8 * adapter.dropout if sparse else 4
        layer += sum(lin.in_features for lin in in_layer) * (lora + mask)
        split += sum(lin.in_features for lin in row_split) * (lora + mask)
    else:
        layer += 4 * _distinct_inputs(in_layer)
        split += 4 * _distinct_inputs(row_split)
    layer += sum(adapter.r * lora + (2 * a * lin.out_features if method == "dora" else 0) for lin in in_layer)
    checkpointed = resid * h  # only the layer input survives; backward recomputes the rest
    saved = tokens * (info.layers * (checkpointed if train.gradient_checkpointing else layer) + 4 * h)
    # packed rows: the mask the kernel needs, built once per forward and kept for backward (attention.py)
    kernel = resolve_attention(recipe, "cuda" if on_gpu else "cpu", here=False)  # model.attn resolved already
    saved += mask_bytes(kernel, train.micro_batch_size, recipe.data.row_len, a,
                        1 if train.gradient_checkpointing else info.layers)
    # Full logits: fp32 log-probabilities, the gradient flowing into them and the one they produce (more
    # than the forward's logits + fp32 upcast). Chunked (workbench/model/lm_loss.py): the hidden states, their
    # gradient computed in forward and its scaled copy, and one chunk of logits at a time. Backward through
    # one layer needs about one layer again on a CPU, whose heap keeps freed blocks apart; CUDA's caching
    # allocator reuses the saved tensors backward frees, so there only a checkpointed layer's recomputation
    # adds a layer (bench/results/gpu_check.md: 1.24B LoRA on an H200 peaked 12% below the CPU rule without
    # checkpointing, 24% below it with).
    one_layer = (2 if train.gradient_checkpointing else 1) * layer if not on_gpu else \
        (layer if train.gradient_checkpointing else 0)
    loss_full = tokens * (12 * info.vocab + one_layer) if on_gpu else tokens * max(12 * info.vocab, one_layer)
    loss = loss_full
    if chunked_loss(recipe, info):
        from workbench.model.lm_loss import CHUNK_ELEMENTS

        # the head cast to the dtype its matmul runs in, when that is not the dtype it is kept in
        head_dtype = vocabulary_dtype(recipe, info)
        matmul_dtype = ("float16" if train.mixed_precision == "fp16" else "bfloat16") if autocast else \
            frozen_dtype_of(recipe)
        head_copy = DTYPE_BYTES[matmul_dtype] * info.vocab * h if matmul_dtype != head_dtype else 0
        if matmul_dtype == "float32" and head_dtype != "float32":  # cast a slice at a time (lm_loss)
            head_copy = 4 * min(info.vocab * h, CHUNK_ELEMENTS)
        chunk = min(tokens * info.vocab, CHUNK_ELEMENTS)
        loss = max(tokens * 3 * resid * h + 3 * 4 * chunk + head_copy, tokens * one_layer)
    if train.scores_sequences:  # a reward model: a score per position (hidden x 1) in place of the logits
        loss = loss_full = tokens * max(3 * 4, one_layer)
    copies = 0.0
    if autocast and method != "full":  # fp32 adapter weights, cast once per forward and kept for backward
        copies += 2 * sum(adapter.r * (lin.in_features + lin.out_features) for lin in targets)
    if autocast and recipe.model.dtype == "float32" and method != "qlora":  # bf16 copies of fp32 weights
        copies += 2 * info.linear_params / (info.layers if train.gradient_checkpointing else 1)
    # a checkpointed run keeps only each layer's input, which every tensor-parallel process holds whole
    tp_split = 0 if train.gradient_checkpointing else tokens * info.layers * split
    return {"saved": int(saved), "loss": int(loss), "loss_full_logits": int(loss_full),
            "autocast_copies": int(copies), "tp_split_saved": int(tp_split)}


# transformers' tensor-parallel plans split these by their input (rowwise); the other layers of a decoder layer
# by their output (colwise), whose input every process holds whole
ROW_SPLIT_LAYERS = ("o_proj", "down_proj", "out_proj", "fc2")


def _row_split(lin) -> bool:
    return lin.name.rsplit(".", 1)[-1] in ROW_SPLIT_LAYERS


def micro_batch_tokens(recipe: Recipe) -> int:
    """Tokens one micro-batch trains on: its rows at full length (a preference pair is two sequences in one row);
    for an objective that samples answers (grpo), each prompt's answers, each the prompt and a completion."""
    if recipe.training.objective_spec.samples_answers:
        grpo = recipe.training.grpo
        return recipe.training.micro_batch_size * grpo.num_generations * (recipe.data.row_len +
                                                                           grpo.max_completion_length)
    return recipe.training.micro_batch_size * recipe.data.row_len


def generation_bytes(recipe: Recipe, info: ModelInfo) -> int:
    """What sampling a micro-batch's answers holds (grpo): the KV cache of every answer at its longest (keys and
    values of each layer, in the compute dtype) and one position's fp32 logits of each. Held while the answers
    are sampled, before the step's forward keeps its activations: the two peak one after the other."""
    if not recipe.training.objective_spec.samples_answers:
        return 0
    grpo = recipe.training.grpo
    answers = recipe.training.micro_batch_size * grpo.num_generations
    cache = (2 * info.layers * info.kv_heads * info.head_dim * (recipe.data.row_len + grpo.max_completion_length)
             * DTYPE_BYTES[compute_dtype_of(recipe)])
    return answers * (cache + 4 * info.vocab)


def fast_lora_inputs(recipe: Recipe) -> bool:
    """Whether workbench/model/fastpath.py handles the LoRA layers' inputs (plain LoRA on 16-bit or fp32 Linears)."""
    return recipe.training.fast_paths and recipe.adapter.method == "lora" and (
        recipe.training.mixed_precision != "no" or recipe.adapter.dropout > 0)


def _distinct_inputs(linears: list) -> int:
    """Input widths of Linears whose input is a tensor of its own: q/k/v and gate/up read one tensor,
    o_proj reads attention's output (already kept by sdpa/flash, which lay it out as o_proj needs)."""
    groups = {}
    for lin in linears:
        parent, leaf = lin.name.rsplit(".", 1)
        if leaf not in ("o_proj", "out_proj", "dense"):
            key = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(leaf, leaf)
            groups[f"{parent}.{key}"] = lin.in_features
    return sum(groups.values())


# -- strategies -------------------------------------------------------------------------------------

def _strategy(layout: Layout, t: dict, dev: Device, world_size: int, nodes: int) -> dict:
    """One layout's memory per device: its sharded parts divided, its offloaded parts moved to the host."""
    local = world_size // nodes
    group = local if layout.hybrid else world_size  # hybrid shards within a node only
    part = {k: t[k] for k in PARTS}
    if layout.keeps_master_weights:
        part["optimizer"] += t["master_weights"]
    part["gradients"] *= layout.gradient_copies
    for key in layout.shards:
        part[key] = math.ceil(part[key] / group)
    if layout.splits_layers:  # each process holds its slice of what tensor parallel splits, the rest whole
        for key, share in (("weights", t["tp_split_weights"]), ("adapter", t["tp_split_adapter"]),
                           ("gradients", t["tp_split_adapter"]), ("optimizer", t["tp_split_adapter"])):
            part[key] = math.ceil(part[key] * (1 - share + share / group))
        split = t["tp_split_saved_activations"]
        t = {**t, "activations": t["activations"] - split + math.ceil(split / group)}
    if layout.pipelines:  # the largest stage: its layers (and embeddings or head), their adapter, its micro-batches
        stage = pipeline_stage_bytes(t, world_size)
        part["weights"] = math.ceil(stage["weights"])
        for key in ("adapter", "gradients", "optimizer"):
            part[key] = math.ceil(part[key] * stage["layers"])
        t = {**t, "activations": int(stage["activations"])}
    other = t["runtime"] + t["autocast_copies"] + t["allocator"] + t["loading"] + t["dequantized_copy"]
    # DeepSpeed's import is charged to its own layouts. (Accelerate's FSDP2 preparation imports it too, through a
    # check for its engine: FSDP runs hold it as well, which this does not count yet.)
    uses_deepspeed = layout.strategy == "deepspeed"
    if dev.kind == "cpu":  # elsewhere it is host memory, below
        other += t["initial_adapter"] + cpu_runtime_bytes(uses_deepspeed) - cpu_runtime_bytes()
    if layout.shards_weights:
        other += t["gathered_root_and_layers"] if layout.strategy == "fsdp" else t["gathered_weights"]
    offloaded = 0
    if dev.kind == "cuda":  # on a CPU the "device" is host RAM already: offloading moves nothing
        for key in layout.offloads:
            offloaded += part[key]
            part[key] = 0
    if layout.shards_weights:  # a sharded head: the loss takes the full-logits path
        t = {**t, "activations": t["activations_full_logits"]}
    activations = _step_bytes(t, part["gradients"]) - part["gradients"]  # beyond the gradients
    breakdown = {**part, "activations": activations, "other": other}
    per_device = sum(breakdown.values())
    if dev.kind == "cpu":
        cpu_bytes = local * per_device
    else:
        # each process: the interpreter, torch and CUDA's host libraries, what it offloads, a PiSSA/OLoRA run's
        # starting adapter. Loading comes first: where the layout shards the weights, one process per machine
        # reads the whole checkpoint into host memory as published (16-bit; 4-bit layers are quantized on their
        # way to the device) and hands each its shard (FSDP's cpu_ram_efficient_loading, ZeRO-3's partitioning
        # of a loaded model); the others wait with none. Published 70B runs: 107-128 GB (docs/estimator.md)
        runtime = cpu_runtime_bytes(uses_deepspeed) + CUDA_HOST_LIBRARIES
        training = local * (runtime + offloaded + t["initial_adapter"])
        loading = local * runtime + (t["checkpoint_bytes"] if layout.shards_weights else 0)
        cpu_bytes = max(training, loading)
    fits = (cpu_bytes if dev.kind == "cpu" else per_device) <= dev.memory
    return {"name": layout.name, "mesh": layout.mesh(world_size, nodes), "per_device_bytes": int(per_device),
            "cpu_bytes": int(cpu_bytes), "fits": bool(fits), "breakdown": {k: int(v) for k, v in breakdown.items()}}


def _notes(strategies: list[dict], recommended: str, dev: Device, world_size: int, terms: dict,
           recipe: Recipe) -> list[str]:
    notes = []
    first = strategies[0]
    if first["fits"]:
        used = f"{format_bytes(first['per_device_bytes'])} of {format_bytes(dev.memory)}"
        if world_size == 1:
            notes.append(f"One {dev.name} is enough ({used}). More devices would multiply the cost "
                         "for a less than proportional speed-up.")
        else:
            notes.append(f"One {dev.name} is enough ({used}): {world_size} devices multiply the device-hours "
                         f"by {world_size} for a speed-up below {world_size}x (gradient all-reduce every step).")
    elif recommended == "none" and any(s["fits"] for s in strategies):
        notes.append("It fits only on layouts this recipe cannot run (the refused lines below say what to change).")
    elif recommended == "none":
        need = next((n for n in (2**k for k in range(1, 13))
                     if n > world_size and _strategy(FSDP, terms, dev, n, 1)["fits"]), None)
        hint = (f"fsdp/zero3 would fit on {need} of them; " if need else
                "sharding alone cannot help (activations are per device); ")
        notes.append(f"Does not fit on {world_size} x {dev.name} with any strategy: {hint}try "
                     "adapter.method=qlora, training.gradient_checkpointing=true, a smaller "
                     "training.micro_batch_size or data.max_seq_len.")
    if recommended.endswith("_offload"):
        notes.append("Offloading moves states to CPU RAM over PCIe: expect several times lower throughput.")
    if not recipe.training.gradient_checkpointing and terms["saved_activations"] > terms["weights"]:
        notes.append("Activations dominate: training.gradient_checkpointing=true stores only each layer's input "
                     "(about 20-30% slower).")
    if dev.kind == "cuda" and not dev.bf16 and recipe.training.mixed_precision == "bf16":
        notes.append(f"{dev.name} has no bf16 tensor cores: use training.mixed_precision=fp16 and model.dtype=float16.")
    if terms["init_flops"]:
        seconds = terms["init_flops"] / cpu_decomposition_rate()
        took = f"{seconds:.2g} s" if seconds < 120 else f"{seconds / 60:.3g} min"
        notes.append(f"adapter.init {recipe.adapter.init}: every target weight is decomposed on the CPU at start-up "
                     f"({terms['init_flops'] / 1e12:.3g} TFLOP, about {took} on this machine's CPU), and "
                     f"the starting adapter is kept in host memory ({format_bytes(terms['initial_adapter'])}) to save the "
                     "trained one for the published base.")
    init = adapter_init.of(recipe)
    if init.needs_data and init.before_adapter:
        notes.append(f"adapter.init {recipe.adapter.init}: forward passes over the first {adapter_init.CORDA_ROWS} "
                     "training rows at start-up collect each target's input covariance (held together: "
                     f"{format_bytes(terms['init_transient'])}).")
    elif init.needs_data:
        notes.append(f"adapter.init {recipe.adapter.init}: forward passes over the first training micro-batches at "
                     "start-up, until each layer's components converge (peft may cycle the first epoch), before the "
                     "first step.")
    if dev.kind == "cpu":
        notes.append("CPU figures are process peak RSS (what runs record); the runtime term is measured in a "
                     "fresh process (cached).")
    return notes


def _splitting_notes(strategies: list[dict], recommended: str, dev: Device, world_size: int, terms: dict,
                     recipe: Recipe) -> list[str]:
    """Where the layouts that split the layers themselves come in: when only they fit (a layer, or a layer's
    activations, larger than what FSDP and ZeRO-3 can shard away), which would fit and at what cost; a pipeline's
    bubble wherever the recipe asks for one."""
    notes = []
    rows = {s["name"]: s for s in strategies}
    data_parallel_fits = any(s["fits"] and not s.get("refused") for s in strategies if s["name"] not in ("tp", "pp"))
    m, schedule = recipe.training.grad_accum, recipe.distributed.pipeline.schedule
    bubble = (f"each stage idles about {pipeline_bubble(world_size, m):.0%} of a step while the pipeline fills and "
              f"drains ({world_size} stages over {m} micro-batch(es), {schedule}: (stages - 1) / (micro-batches + "
              "stages - 1))") if world_size > 1 else ""
    if world_size > 1 and not data_parallel_fits:
        fitting = []
        if rows.get("tp", {}).get("fits"):
            fitting.append(f"tp at {format_bytes(rows['tp']['per_device_bytes'])} a device (each decoder layer's "
                           "weights split over the processes, a collective in every layer: inside one machine)")
        if rows.get("pp", {}).get("fits"):
            fitting.append(f"pp at {format_bytes(rows['pp']['per_device_bytes'])} a device (consecutive layers a "
                           f"process; {bubble}: across machines for very deep models)")
        if fitting:
            notes.append("Only the layouts that split the layers fit: " + "; ".join(fitting) + ".")
    elif recipe.distributed.strategy == "pp" and bubble:
        notes.append(f"pp: {bubble}.")
    return notes


# -- throughput and cost ----------------------------------------------------------------------------


def _throughput(recipe: Recipe, info: ModelInfo, dev: Device, world_size: int, price: float | None) -> dict:
    """FLOPs per token as workbench.base.metrics.FlopCounter counts them, plus the recomputation of checkpointing."""
    lora = sum(recipe.adapter.r * (lin.in_features + lin.out_features) for lin in lora_targets(recipe, info))
    weights = info.linear_params + lora  # every matmul weight, LoRA factors and lm_head included
    trainable = min(info.params if recipe.adapter.method == "full" else lora, weights)
    seq = recipe.data.max_seq_len
    attention = 12 * info.layers * info.heads * info.head_dim * (seq + 1) / 2  # causal: (T+1)/2 positions
    model_flops = 4 * weights + 2 * trainable + attention
    model_flops += recipe.training.extra_forwards * (2 * weights + attention / 3)  # without gradients
    hardware_flops = model_flops + (2 * weights if recipe.training.gradient_checkpointing else 0)
    peak = dev.peak(compute_dtype_of(recipe))
    per_device = peak * dev.mfu / hardware_flops
    out = {"flops_per_token": int(model_flops), "hardware_flops_per_token": int(hardware_flops),
           "peak_flops": peak, "mfu": dev.mfu, "tokens_per_s_per_device": round(per_device, 1),
           "tokens_per_s": round(per_device * world_size, 1), "epoch_tokens": None, "epoch_hours": None,
           "gpu_hours": None, "cost": None, "price_per_gpu_hour": price}
    tokens = data_tokens(recipe)
    if tokens:
        hours = tokens / (per_device * world_size) / 3600
        out.update(epoch_tokens=tokens, epoch_hours=hours, gpu_hours=hours * world_size,
                   cost=hours * world_size * price if price is not None else None)
    return out


def data_tokens(recipe: Recipe) -> int | None:
    """Tokens in one epoch of local training files: their text characters / 4, each source times its weight
    (None when a source is not a local file)."""
    if recipe.data.streaming:  # a stream is read as it trains, never whole up front (and has no epochs)
        return None
    counts = [_file_tokens(Path(source.path), recipe.data.limit) for source in recipe.data.sources]
    if any(count is None for count in counts):
        return None
    # an unpaired row trains as two sequences of about its length: its answer, and another's (KTO's KL sample)
    twice = 2 if format_of(recipe.data.format).unpaired else 1
    return max(1, round(twice * sum(count * source.weight for count, source in zip(counts, recipe.data.sources))))


def _file_tokens(path: Path, limit: int | None) -> int | None:
    """A file's text characters / 4, read a line at a time (a JSON array whole): its size does not matter."""
    suffix = path.suffix.lower()
    if not path.is_file() or suffix not in (".jsonl", ".json", ".csv"):
        return None
    if suffix == ".json":
        items = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        chars = [_text_chars(item) for item in (items if isinstance(items, list) else [items])][:limit]
        return max(1, int(sum(chars) / CHARS_PER_TOKEN))
    total = rows = 0
    with path.open(encoding="utf-8", errors="replace") as lines:
        if suffix == ".csv":
            next(lines, None)  # the header
        for line in lines:
            if limit and rows >= limit:
                break
            if not line.strip():
                continue
            total += len(line.rstrip("\n")) if suffix == ".csv" else _text_chars(json.loads(line))
            rows += 1
    return max(1, int(total / CHARS_PER_TOKEN))


def _text_chars(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0

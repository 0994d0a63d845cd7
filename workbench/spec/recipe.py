"""The recipe: one typed YAML document that says what to train and how.

Every field is typed, defaulted and documented; unknown keys are refused with the
closest valid name suggested. `Recipe.load(path, overrides)` is the only way in,
for the CLI, the Python API and the UI alike.
"""

from __future__ import annotations

import contextvars
import difflib
import string
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator,
                      model_validator)

from workbench.base.errors import RecipeError, WorkbenchError, escaped
from workbench.base.units import parse_bytes
from workbench.spec.adapter_init import INITS, LOFTQ_REFUSED
from workbench.spec.chat_templates import NAMES as CHAT_TEMPLATES, check_value as _chat_template_value
from workbench.spec.compat import check_recipe
from workbench.spec.formats import FORMAT_NAMES, FORMATS
from workbench.spec.objectives import DEFAULT_OBJECTIVE, OBJECTIVE_NAMES, OBJECTIVES, Objective
from workbench.spec.rewards import BUILTINS as BUILTIN_REWARDS, SETTINGS as REWARD_SETTINGS
from workbench.spec.rewards import entry_problem as reward_entry_problem

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")  # workbench/training/policy_gradient.py's LOSS_TYPES

# What users type for each value (YAML reads `no` as false): mapped onto the schema's spelling.
MIXED_PRECISION_SPELLINGS = {
    "auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "no": "no", "none": "no", "false": "no", "off": "no", "fp32": "no", "float32": "no", "full": "no",
}
DTYPE_SPELLINGS = {
    "auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
    "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32", "full": "float32",
}


def spelled(value, spellings: dict[str, str]):
    """A user's spelling of a precision (`no`, False, `fp32`, `BF16`) in the schema's words; others unchanged."""
    if value is False or value is None:
        value = "false" if value is False else value
    if isinstance(value, str) and value.strip().lower() in spellings:
        return spellings[value.strip().lower()]
    return value


FORMATS_READ = {rows: [name for name, f in FORMATS.items() if f.rows == rows]
                for rows in {f.rows for f in FORMATS.values()}}
TARGET_PRESETS = ("all-linear", "attention", "mlp")
_FROM_DICT = contextvars.ContextVar("recipe_from_dict", default=False)
_SHORT = reprlib.Repr()  # for values quoted in messages: short, however big the value
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 80, 80, 2, 4, 4


_NUMBERS = (int, float, int | None, float | None)


# The mark of a field that names a file or folder of the user's (json_schema_extra). A launcher whose workers run
# elsewhere (cluster/ray.py) makes every marked field absolute through `with_paths_changed`, so a path field added
# without it is caught by tests/cluster/test_ray.py, not by a user's job failing on every worker.
# "existing": made absolute when it names something that exists (else it is a hub id, a builtin or one of `names`);
# "output": always (the run makes it).
def path_mark(kind: Literal["existing", "output"] = "existing", names: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"path": kind, "names": list(names)}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # no lr: .inf

    @field_validator("*", mode="before")
    @classmethod
    def _no_true_for_a_number(cls, value, info):
        """pydantic reads true as 1 and false as 0 (`shuffle_buffer: true` would mean a buffer of one row, no
        shuffling): a number field takes a number."""
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in _NUMBERS:
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


# Positions a model may say it was trained for: 16 M, above every published model's (1 M at most); a larger
# number is a typo, which times the factor would become a context no check could refuse.
LONGEST_TRAINED_CONTEXT = 1 << 24


class RopeScalingSection(Section):
    type: Literal["linear", "dynamic", "yarn", "llama3"] = Field(
        ..., description="how positions stretch (see workbench/spec/rope_scaling.py).")
    factor: float = Field(..., gt=1, le=64, description="the new context is the original times this.")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, le=LONGEST_TRAINED_CONTEXT, strict=True,
        description="the context the model was trained for (default: its config's).")


class ModelSection(Section):
    path: str = Field("builtin:tiny", description="builtin:tiny, builtin:smollm2-135m, a local folder or a hub id.",
                      json_schema_extra=path_mark())
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="dtype of the frozen base weights (auto: what the device computes fastest; "
                            "see workbench/hardware/precision.py)."
    )
    attn: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "auto", description="attention kernel (auto: FlexAttention for packed rows on a GPU, else sdpa; "
                            "see workbench/model/attention.py).")
    trust_remote_code: bool = Field(False, description="allow model code from the hub repository.")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit).")
    rope_scaling: RopeScalingSection | None = Field(
        None, description="RoPE scaling for a longer context: {type: linear|dynamic|yarn|llama3, factor: 2}.")

    _dtype_spelling = field_validator("dtype", mode="before")(lambda value: spelled(value, DTYPE_SPELLINGS))


class AdapterSection(Section):
    method: Literal["lora", "qlora", "dora", "full"] = Field("lora", description="what to train.")
    r: int = Field(16, gt=0, strict=True, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA alpha (scaling = alpha / r, or alpha / sqrt(r) with rslora).")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the LoRA input.")
    target_modules: str | list[str] = Field(
        "all-linear", description="all-linear | attention | mlp, or a list of module names."
    )
    rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r).")
    modules_to_save: list[str] | None = Field(None, description="modules trained in full beside the adapter.")
    init: str = Field("default", description=f"how the adapter starts: {' | '.join(INITS)} "
                                             "(see workbench/spec/adapter_init.py).")
    lora_plus_ratio: float | None = Field(None, ge=1, le=1024, description="LoRA+: B's learning rate is this "
                                                                            "many times training.lr (e.g. 16); "
                                                                            "null: one rate.")
    lora_plus_lr_embedding: float = Field(1e-6, gt=0, description="LoRA+: the learning rate of the LoRA factors "
                                                                  "on embedding layers, whatever training.lr "
                                                                  "(peft's loraplus_lr_embedding).")

    @field_validator("lora_plus_ratio", "lora_plus_lr_embedding", mode="before")
    @classmethod
    def _a_number(cls, value, info):
        if isinstance(value, bool):  # YAML's true would pass as a ratio (or a rate) of 1
            example = "16" if info.field_name == "lora_plus_ratio" else "1e-6"
            raise ValueError(f"expected a number such as {example}, got {value}")
        return value

    @field_validator("init")
    @classmethod
    def _known_init(cls, value):
        if value == "loftq":
            raise ValueError(LOFTQ_REFUSED)
        if value not in INITS:
            raise ValueError(f"must be one of {', '.join(INITS)}, got {value!r}")
        return value

    @field_validator("target_modules")
    @classmethod
    def _known_preset(cls, value):
        if isinstance(value, str) and value not in TARGET_PRESETS:
            raise ValueError(f"must be one of {', '.join(TARGET_PRESETS)} or a list of module names")
        if isinstance(value, list) and not value:
            raise ValueError("the list of module names is empty")
        return value


class QuantizationSection(Section):
    bits: Literal[4, 8] = Field(4, description="4-bit (NF4/FP4) or 8-bit base weights (qlora only).")
    type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="quantize the quantization constants too.")
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="matmul dtype of the quantized layers (auto: follows training.mixed_precision).")
    quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = Field(
        "uint8", description="storage dtype of packed 4-bit weights (bfloat16 lets FSDP shard them)."
    )
    upcast_frozen: bool = Field(
        False, description="keep the frozen weights that are not quantized (embeddings, head, norms) in float32, "
                           "as peft's k-bit preparation does; default: the model dtype (norms and the loss "
                           "compute in float32 either way).")

    _dtype_spelling = field_validator("compute_dtype", "quant_storage", mode="before")(
        lambda value: spelled(value, DTYPE_SPELLINGS))


class DataSource(Section):
    path: str = Field(..., description="jsonl/json/csv/parquet file or hub data set.", json_schema_extra=path_mark())
    format: Literal[FORMAT_NAMES] | None = Field(None, description="its row layout; null: data.format.")
    weight: float = Field(1.0, gt=0, le=1000, description="its rows per epoch, as a multiple of the rows it has: 2 "
                                                          "repeats every row, 0.5 keeps a seeded half.")

    @model_validator(mode="before")
    @classmethod
    def _a_bare_path(cls, data):
        return {"path": data} if isinstance(data, str) else data

    @field_validator("weight", mode="before")
    @classmethod
    def _a_number(cls, value):
        if isinstance(value, bool):  # YAML's true would pass as a weight of 1
            raise ValueError(f"expected a number such as 2 or 0.5, got {value}")
        return value


def _one_or_several(value) -> str:
    return "several" if isinstance(value, list) else "one"


class DataSection(Section):
    train: Annotated[Union[Annotated[str, Tag("one")], Annotated[list[DataSource], Tag("several")]],
                     Discriminator(_one_or_several)] = Field(
        "recipes/data/tiny_chat.jsonl",
        description="jsonl/json/csv/parquet file or hub data set, or a list of sources mixed into one training set: "
                    "[{path, format, weight}, ...] (workbench/data/pipeline.py mix_sources).",
        json_schema_extra=path_mark())  # its list form: each source's own path is marked
    eval: str | None = Field(None, description="held-out file; omitted: eval_split of train is held out.",
                             json_schema_extra=path_mark())
    eval_split: float = Field(0.0, ge=0, lt=1, description="fraction of train held out when eval is not given.")
    split: str = Field("train", description="split name for hub data sets.")
    format: Literal[FORMAT_NAMES] = Field("chat", description="row layout (workbench/spec/formats.py): "
                                          + "; ".join(f"{f.name}: {f.summary}" for f in FORMATS.values()) + ".")
    max_seq_len: int = Field(512, ge=8, description="longest tokenized sequence; longer samples are truncated.")
    packing: bool = Field(True, description="pack samples into full sequences (each attends only to itself).")
    train_on: Literal["completions", "all"] = Field("completions", description="which tokens carry loss.")
    system_prompt: str | None = Field(None, description="system message added to chat/alpaca rows without one.")
    chat_template: str | None = Field(None, description="the chat template in place of the tokenizer's own: "
                                      + ", ".join(CHAT_TEMPLATES) + " (workbench/spec/chat_templates.py) or the path of a "
                                      "Jinja file; its turns must end with a token of the tokenizer's own.",
                                      json_schema_extra=path_mark(names=tuple(CHAT_TEMPLATES)))
    limit: int | None = Field(None, gt=0, description="use only the first N training rows.")
    streaming: bool = Field(False, description="read data.train as a stream (workbench/data/streaming.py): rows are "
                            "shuffled in a buffer, tokenized and packed as training reads them, with no copy or "
                            "cache on disk; for a source larger than memory or disk. Needs training.max_steps.")
    shuffle_buffer: int = Field(10_000, gt=0, le=10_000_000,
                                description="with streaming: rows held for shuffling (a larger buffer mixes a sorted "
                                            "source better; memory grows with it times a row's size).")

    _chat_template = field_validator("chat_template")(lambda value: _chat_template_value(value))

    @field_validator("train")
    @classmethod
    def _sources_agree(cls, value, info):
        if isinstance(value, list) and not value:
            raise ValueError("an empty list of sources: give a file, or a list of {path, format, weight}")
        return value

    @property
    def sources(self) -> list[DataSource]:
        """The training sources, each with its format: one for a plain data.train."""
        if isinstance(self.train, str):
            return [DataSource(path=self.train, format=self.format)]
        return [s if s.format else s.model_copy(update={"format": self.format}) for s in self.train]

    @property
    def train_name(self) -> str:
        """data.train in messages: the file, or its sources joined."""
        return self.train if isinstance(self.train, str) else " + ".join(s.path for s in self.train)

    @property
    def row_len(self) -> int:
        """The longest row a batch holds: max_seq_len per sequence, two sequences for a preference pair or an
        unpaired row (its answer and KTO's mismatched one)."""
        return self.max_seq_len * FORMATS[self.format].sequences_per_example

    @property
    def several_samples_per_row(self) -> bool:
        """Whether rows hold several samples, each attending only to itself (packing, a preference pair, an
        unpaired row)."""
        return self.packing or FORMATS[self.format].sequences_per_example > 1


class RewardEntry(Section):
    name: str = Field(..., description="a built-in reward (workbench/spec/rewards.py): " + "; ".join(
        f"{b.name} ({b.summary})" for b in BUILTIN_REWARDS.values()) + "; or module:function (Python code, run only "
        "with training.grpo.allow_code_rewards: true).")
    pattern: str | None = Field(None, description="format: the regular expression an answer must contain.")
    target_length: int | None = Field(None, gt=0, description="length: the tokens an answer may take unpenalised.")
    keys: list[str] | None = Field(None, description="json: the keys the answer's object must hold.")

    @model_validator(mode="before")
    @classmethod
    def _a_name_alone(cls, data):
        return {"name": data} if isinstance(data, str) else data  # `- exact_answer` for `- {name: exact_answer}`


class GrpoSection(Section):
    num_generations: int = Field(8, ge=2, le=1024, strict=True,
                                 description="G: answers sampled per prompt; each is judged against its group's "
                                             "mean reward (at least 2).")
    max_completion_length: int = Field(256, gt=0, le=1 << 17, strict=True,
                                       description="the most tokens an answer is sampled for.")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature (the log-probabilities are "
                                                             "scored at it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens holding this "
                                                      "much probability (1: all).")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens (0: all).")
    loss_type: Literal[GRPO_LOSS_TYPES] = Field(
        "dapo", description="how token losses are averaged (TRL's loss_type, default dapo as TRL 1.16): grpo (each "
                            "answer's token mean, then the mean over answers), bnpo (the micro-batch's token mean), "
                            "dr_grpo (sum over batch x max_completion_length), dapo (the step's token mean), cispo "
                            "(dapo's mean of the capped-ratio policy gradient).")
    epsilon: float = Field(0.2, gt=0, lt=1, description="clipping: the ratio to the sampling policy is kept in "
                                                       "[1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = Field(None, gt=0, description="the upper clip (null: epsilon); cispo: the cap of "
                                                               "the ratio (e.g. 5).")
    beta: float = Field(0.0, ge=0, description="weight of the KL penalty to the base model (adapter off); 0: no "
                                               "reference pass (TRL's default).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantages: reward minus the group's mean, divided by the group's std (group), the "
                             "micro-batch's std (batch) or not at all (none).")
    rewards: list[RewardEntry] = Field(
        default_factory=lambda: [RewardEntry(name="exact_answer")],
        description="the rewards an answer is scored by, summed with reward_weights: a name, or {name, settings}.")
    reward_weights: list[float] | None = Field(None, description="one weight per reward (null: all 1).")
    allow_code_rewards: bool = Field(False, description="let rewards name Python code (module:function) to import "
                                                        "and run.")

    @model_validator(mode="after")
    def _rewards_usable(self):
        if not self.rewards:
            raise ValueError("rewards: empty; name at least one (e.g. exact_answer)")
        for k, entry in enumerate(self.rewards):
            settings = {name: getattr(entry, name) for name in REWARD_SETTINGS}
            problem = reward_entry_problem(entry.name, settings, self.allow_code_rewards)
            if problem:
                raise ValueError(f"rewards[{k}]: {problem}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"reward_weights: {len(self.reward_weights)} weights for {len(self.rewards)} rewards; "
                             "give one per reward")
        return self


MOST_SAMPLES_PER_STEP = 1 << 20  # far past any published run's (a few thousand); a larger one is a typo


class TrainingSection(Section):
    epochs: float = Field(1, gt=0, description="passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="optimizer steps to run; overrides epochs.")
    micro_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        4, description="sequences per forward pass per device. auto: the largest split of training.batch_size "
                       "(micro-batch x accumulation) that fits the device, by the estimate and then by "
                       "training.fit_check's measured step; a resume keeps the split its run took.")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step (chosen with micro_batch_size "
                                                 "auto: leave it at 1).")
    batch_size: int | None = Field(None, gt=0, le=MOST_SAMPLES_PER_STEP, description="samples of one optimizer step on each process "
                                                           "(micro_batch_size x grad_accum): what micro_batch_size "
                                                           "auto splits; beside a number, it must equal the product.")
    lr: float = Field(2e-4, gt=0, description="peak learning rate.")
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after warmup.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="fraction of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field("adamw", description="optimizer.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping norm (null: no clipping).")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a NaN/Inf loss or gradient: stop the run (keeping the last good checkpoint), or skip "
                            "that step's update and go on.")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory.")
    activation_offloading: bool = Field(False, description="keep saved activations in CPU memory (GPU only).")
    fit_check: Literal["auto", True, False] = Field(
        "auto", description="before the run directory is written, one forward, backward and optimizer step on the "
                            "longest micro-batch of the data, measured against the device's memory "
                            "(distributed.device_memory where set); a step that does not fit stops the run there, "
                            "naming the term that overflowed and the settings that keep the global batch and fit. "
                            "auto: on an accelerator, and on a CPU where distributed.device_memory sets a budget.")
    compile: bool = Field(False, description="torch.compile each decoder layer (Accelerate's regional compilation): "
                                             "faster steps on a GPU after a minute of compiling; rarely pays on a CPU.")
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = Field(
        "auto", description="autocast precision: auto (bf16 where the device computes it natively, fp16 on GPUs "
                            "without bf16, else full precision), bf16, fp16, or no (also: fp32, false).")
    fast_paths: bool = Field(
        True, description="the loop's faster paths, same results: per-sample attention over packed rows (CPU), "
                          "LM head over target positions a chunk at a time, no float32 copy of LoRA inputs under "
                          "autocast, dropout drawing only where it drops (CPU). false: the libraries' own paths.")
    objective: Literal[OBJECTIVE_NAMES] = Field(
        DEFAULT_OBJECTIVE, description="what the loss optimizes (workbench/spec/objectives.py): " + "; ".join(
            f"{o.name} ({o.summary}; data.format: {' or '.join(FORMATS_READ[o.rows])})" for o in OBJECTIVES.values()))
    dpo_beta: float = Field(0.1, gt=0, description="DPO's beta: how strongly the tuned model is held to the "
                                                   "reference (larger: smaller steps away from it).")
    orpo_lambda: float = Field(0.1, gt=0, description="ORPO's lambda: the weight of the odds-ratio term beside "
                                                      "the chosen answer's next-token loss.")
    kto_beta: float = Field(0.1, gt=0, description="KTO's beta: how strongly the tuned model is held to the "
                                                   "reference (as dpo_beta).")
    kto_desirable_weight: float = Field(1.0, gt=0, description="KTO: the weight of the desirable rows' losses.")
    kto_undesirable_weight: float = Field(1.0, gt=0, description="KTO: the weight of the undesirable rows' losses "
                                                                 "(raise it when they are the fewer).")
    reward_center_coefficient: float | None = Field(
        None, ge=0, description="reward: the weight of a penalty on the squared sum of each pair's rewards, which "
                                "keeps them centred on 0 (null: none).")
    grpo: GrpoSection = Field(default_factory=GrpoSection,
                              description="objective grpo: sampling, rewards and the clipped policy loss.")
    seed: int = Field(42, description="seed for weights, dropout and data order.")
    resume: Literal[False, "auto"] = Field(
        False, description="auto: a start with no checkpoint in the run directory trains from scratch, one with a "
                           "checkpoint resumes it exactly (what a requeued or restarted cluster job needs: the "
                           "same command every time); false: --resume and --overwrite decide.")
    threads: int | None = Field(None, gt=0, description="CPU threads per process (null: OMP_NUM_THREADS when set, "
                                                          "else cores / local processes).")

    _precision_spelling = field_validator("mixed_precision", mode="before")(
        lambda value: spelled(value, MIXED_PRECISION_SPELLINGS))

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _micro_batch_spelling(cls, value):
        # one message for both sides of the union (pydantic would name each, and read true as 1)
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        if isinstance(value, str) and value.strip().isdigit() and int(value) > 0:
            return int(value)
        shown = str(value).lower() if isinstance(value, bool) else repr(value)[:40]
        raise ValueError(f"must be a whole number above 0, or auto; got {shown}")

    @model_validator(mode="after")
    def _batch_split(self):
        if self.micro_batch_size == "auto":
            if self.batch_size is None:
                raise ValueError("micro_batch_size auto splits training.batch_size (the samples of one optimizer "
                                 "step on each process) into micro-batch x accumulation: set batch_size")
            if self.grad_accum != 1:
                raise ValueError(f"grad_accum {self.grad_accum} beside micro_batch_size auto, which chooses it: "
                                 f"leave grad_accum at 1 (the step's samples are batch_size, {self.batch_size})")
        elif self.batch_size is not None and self.batch_size != self.micro_batch_size * self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} is not micro_batch_size x grad_accum "
                             f"({self.micro_batch_size} x {self.grad_accum} = "
                             f"{self.micro_batch_size * self.grad_accum}): set one side to match, or "
                             "micro_batch_size: auto to have the split chosen")
        return self

    @property
    def micro_batch_auto(self) -> bool:
        """Whether the micro-batch is chosen per run (workbench/estimator/micro_batch.py), not set."""
        return self.micro_batch_size == "auto"

    @property
    def objective_spec(self) -> Objective:
        """The objective's entry in the registry: its rows, reference, extra passes and what it leaves behind."""
        return OBJECTIVES[self.objective]

    @property
    def has_reference(self) -> bool:
        """Whether the objective scores answers against a reference: the base model, adapter off (dpo, kto)."""
        return self.objective_spec.reference

    @property
    def extra_forwards(self) -> int:
        """Forward passes without gradients beside the one with, per micro-batch (workbench/training/objectives.py): the
        reference over every sample (dpo, kto), the policy over KTO's KL samples. The FLOP counts read it."""
        return self.objective_spec.extra_forwards

    @property
    def scores_sequences(self) -> bool:
        """Whether the model is a sequence scorer (a reward model: the base with a scalar `score` head in place of
        its LM head, read at each answer's last token) rather than a language model."""
        return self.objective_spec.scores_sequences


class FsdpSection(Section):
    sharding: Literal["full", "hybrid"] = Field("full", description="full shard, or hybrid (shard within a node).")
    reshard_after_forward: bool = Field(True, description="free gathered weights after forward.")
    cpu_offload: bool = Field(False, description="keep parameters and optimizer states in CPU memory.")
    activation_checkpointing: bool = Field(False, description="FSDP's own activation checkpointing.")
    state_dict: Literal["sharded", "full"] = Field("sharded", description="checkpoint layout.")
    cpu_ram_efficient_loading: bool = Field(True, description="load weights on rank 0 only, then broadcast.")


class PipelineSection(Section):
    schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b", description="strategy pp's schedule (torch.distributed.pipelining): 1f1b (one forward, one backward "
                            "in turn: at most as many micro-batches' activations in flight as there are stages; needs "
                            "training.grad_accum at least the number of stages) or gpipe (every forward, then every "
                            "backward: all of the step's micro-batches in flight). The step's micro-batches "
                            "(training.grad_accum of them) are the pipeline's.")


class DeepSpeedSection(Section):
    stage: Literal[1, 2, 3] = Field(2, description="ZeRO stage.")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="optimizer states to CPU.")
    offload_params: Literal["none", "cpu"] = Field("none", description="parameters to CPU (stage 3).")
    save_16bit_model: bool = Field(True, description="gather 16-bit weights on save (stage 3).")
    config_file: str | None = Field(None, description="a DeepSpeed JSON file used instead of the generated one.",
                                    json_schema_extra=path_mark())


WEEK_S = 7 * 24 * 3600  # longer limits overflow torch's timedelta arithmetic


class DistributedSection(Section):
    strategy: Literal["auto", "single", "ddp", "fsdp", "deepspeed", "tp", "pp"] = Field(
        "auto", description="auto chooses from the world size and the memory estimate; tp: tensor parallel, each "
                            "process holds a slice of every layer's weights and all read the same batches; pp: "
                            "pipeline parallel, each process holds a run of consecutive layers (a stage) and the "
                            "step's micro-batches flow through the stages (docs/scale-out.md)."
    )
    device_memory: str | None = Field(
        None, description="memory per device that auto plans for (e.g. 40GB); default: the device's own.")
    timeout_s: float = Field(
        60, ge=1, le=WEEK_S, description="seconds a collective may wait for the other processes before the run "
                                         "stops, naming the step and the processes that did not answer.")
    startup_timeout_s: float = Field(
        600, ge=1, le=WEEK_S, description="seconds the processes may take to find each other and prepare the "
                                          "data (and rank 0 to write a checkpoint).")
    fsdp: FsdpSection = Field(default_factory=FsdpSection)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)

    @field_validator("device_memory", mode="before")
    @classmethod
    def _readable_memory(cls, value):
        if value is None:
            return None

        try:
            size = parse_bytes(value)
        except (WorkbenchError, ValueError, OverflowError) as err:
            raise ValueError(str(err) if isinstance(err, WorkbenchError) else
                             f"device memory: cannot read {value!r} (use bytes or e.g. 24GiB, 80GB)") from None
        if size < 2**20:
            raise ValueError(f"device memory: {value!r} is {size} bytes; give bytes or a unit, e.g. 24GiB")
        return str(value)

    @field_validator("timeout_s", "startup_timeout_s", mode="before")
    @classmethod
    def _seconds_not_bool(cls, value):
        if isinstance(value, bool):
            raise ValueError("expected a number of seconds, got a boolean")
        return value


class OutputSection(Section):
    dir: str = Field("runs/{name}", description="run directory; {name} is the recipe name.",
                     json_schema_extra=path_mark("output"))

    @field_validator("dir")
    @classmethod
    def _known_placeholders(cls, value: str) -> str:
        try:
            fields = [(f, spec, conversion) for _, f, spec, conversion in string.Formatter().parse(value)
                      if f is not None]
        except ValueError as err:
            raise ValueError(f"{value!r}: {err}") from None
        if any(f != "name" or spec or conversion for f, spec, conversion in fields):
            raise ValueError(f"{value!r}: the only placeholder is a plain {{name}}")
        return value
    save_every: int | None = Field(100, gt=0, description="checkpoint every N steps (null: never).")
    keep_last: int = Field(2, gt=0, description="checkpoints kept on disk.")
    eval_every: int | None = Field(100, gt=0, description="evaluate every N steps (null: only first and last).")
    log_every: int = Field(10, gt=0, description="write a metrics row every N steps.")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="also send the metrics, the recipe and the summary to these (files in "
                                          "the run directory unless WANDB_DIR or MLFLOW_TRACKING_URI say otherwise; "
                                          "see docs/trackers.md).")
    sample_prompts: list[str] = Field(
        default_factory=list, description="prompts answered before and after training, saved in run.json."
    )
    sample_max_new_tokens: int = Field(48, gt=0, description="length of those answers.")


class Recipe(Section):
    """A fine-tuning recipe. Build it with `Recipe.load(path)` or `Recipe(**sections)`."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100, description="run name.")
    model: ModelSection = Field(default_factory=ModelSection)
    adapter: AdapterSection = Field(default_factory=AdapterSection)
    quantization: QuantizationSection | None = Field(None, description="base-weight quantization (qlora).")
    data: DataSection = Field(default_factory=DataSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    output: OutputSection = Field(default_factory=OutputSection)

    def __init__(self, /, **sections: Any):
        if _FROM_DICT.get():  # from_dict reports the errors itself, naming its source
            return super().__init__(**sections)
        try:
            super().__init__(**sections)
        except ValidationError as err:  # the project's own error, one line per problem, from Python too
            raise RecipeError(_describe(err, "recipe")) from None

    @model_validator(mode="before")
    @classmethod
    def _qlora_quantizes(cls, data):
        # qlora without a quantization section means the standard 4-bit NF4 setup.
        if isinstance(data, dict) and isinstance(data.get("adapter"), dict):
            if data["adapter"].get("method") == "qlora" and data.get("quantization") is None:
                data = {**data, "quantization": {}}
        return data

    @model_validator(mode="after")
    def _compatible(self):
        check_recipe(self)
        return self

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "recipe") -> "Recipe":
        if not isinstance(data, dict):
            raise RecipeError(f"{source}: a recipe must be a YAML mapping, got {type(data).__name__}")
        odd = [k for k in data if not isinstance(k, str)]
        if odd:
            raise RecipeError(f"{source}: {_SHORT.repr(odd[0])}: a section name must be text (e.g. training)")
        token = _FROM_DICT.set(True)
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise RecipeError(_describe(err, source)) from None
        finally:
            _FROM_DICT.reset(token)

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | dict[str, Any] | None = None) -> "Recipe":
        """Read a YAML recipe and apply `key=value` overrides (or a {dotted.key: value} dict)."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
            raise RecipeError(f"{escaped(path)}: cannot read recipe "
                              f"({getattr(err, 'strerror', None) or err})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise RecipeError(f"{escaped(path)}:{line}: not UTF-8 text (byte {raw[err.start]:#04x})") from None
        data = parse_recipe_yaml(text, str(path))
        if isinstance(data, dict):
            data = apply_overrides(data, overrides or [])
        return cls.from_dict(data, source=str(path))

    def override(self, /, *dotlist: str, **values: Any) -> "Recipe":  # /: a field may be called anything
        """A copy with `key=value` strings and/or `section__field=value` keywords applied."""
        flat = {k.replace("__", "."): v for k, v in values.items()}
        data = apply_overrides(self.to_dict(), list(dotlist))
        data = apply_overrides(data, flat)
        return Recipe.from_dict(data, source="override")

    # -- output -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir.format(name=self.name))


def path_fields(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, dict[str, Any]]:
    """{dotted name: path mark} of every field marked as a path (`path_mark`); a list's items are named `[]`."""
    found = {}
    for name, field in (model or Recipe).model_fields.items():
        mark = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "path" in mark:
            found[prefix + name] = mark
        for nested, listed in _sections_in(field.annotation):
            found |= path_fields(nested, f"{prefix}{name}{'[]' if listed else ''}.")
    return found


def with_paths_changed(recipe: Recipe, change) -> Recipe:
    """The recipe with each path field's value (text, not null) replaced by change(value, mark)."""
    data = recipe.to_dict()
    _change_paths(Recipe, data, change)
    return Recipe.from_dict(data, source="paths")


def _change_paths(model: type[BaseModel], data: dict, change) -> None:
    for name, field in model.model_fields.items():
        value = data.get(name)
        mark = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "path" in mark and isinstance(value, str):
            data[name] = change(value, mark)
        for nested, _ in _sections_in(field.annotation):
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, dict):
                    _change_paths(nested, item, change)


def _sections_in(annotation, listed: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The sections a field's type holds (through Optional, Union, Annotated and list), each with whether it
    stands in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, listed)]
    inner = listed or getattr(annotation, "__origin__", None) is list
    return [found for arg in getattr(annotation, "__args__", ()) for found in _sections_in(arg, inner)]


def parse_recipe_yaml(text: str, source: str) -> Any:
    """What a recipe's YAML text holds ({} for an empty text); RecipeError naming `source:line` otherwise.
    The CLI, the Python API and the UI's YAML editor all read recipes through this."""
    source = escaped(source)  # a file name's line break must not split the error's line
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise RecipeError(f"{where}: invalid YAML ({getattr(err, 'problem', None) or _first_line(err)})") from None
    except RecursionError:
        raise RecipeError(f"{source}: invalid YAML (nested too deeply)") from None
    except Exception as err:  # PyYAML's constructors raise bare ValueError, KeyError... for `!!int abc`
        raise RecipeError(f"{source}: invalid YAML ({_first_line(err)})") from None
    return {} if data is None else data  # an empty text: every default


def apply_overrides(data: dict[str, Any], overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a nested dict. Strings `a.b=v` are parsed with YAML (`1e-4`, `[q,v]`, `null`)."""
    data = _deepcopy(data)
    items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides]
    for key, value in items:
        if not isinstance(key, str):
            raise RecipeError(f"override {key!r}: the key must be a dotted name, e.g. training.lr")
        node = data
        parts = key.split(".")
        if not all(parts):
            raise RecipeError(f"override {key!r}: empty name in the dotted key, e.g. training.lr")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise RecipeError(f"{_printable(where)}: is not a section, cannot set {_printable(key)}")
            node = child
        node[parts[-1]] = value
    return data


def _split_override(text: str) -> tuple[str, Any]:
    if not isinstance(text, str):
        raise RecipeError(f"override {text!r}: expected a key=value string, e.g. training.lr=1e-4")
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"override {text!r}: expected key=value, e.g. training.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except Exception:  # not YAML (PyYAML also raises ValueError, KeyError... for `!!int x`): the text itself
        value = raw
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads "1e-4" as a string
    return key.strip(), value


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return any(c.isdigit() for c in text)


def _deepcopy(data, memo: dict | None = None):
    # YAML aliases can share a node many times or put it inside itself: copy each node once
    memo = {} if memo is None else memo
    if id(data) in memo:
        return memo[id(data)]
    if isinstance(data, dict):
        copy = memo[id(data)] = {}
        for k, v in data.items():  # a loop, not a comprehension: one stack frame per level
            copy[k] = _deepcopy(v, memo)
        return copy
    if isinstance(data, list):
        copy = memo[id(data)] = []
        for v in data:
            copy.append(_deepcopy(v, memo))
        return copy
    return data


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _describe(err: ValidationError, source: str) -> str:
    """One line per problem: `source: a.b.c: what is wrong`, with a suggestion for unknown keys."""
    lines, source = [], escaped(source)  # a recipe file's name with a line break must not split its line
    for problem in err.errors():
        # a key "a\nb" must not break the line; the tags of data.train's two shapes are no key
        raw = problem["loc"]
        loc = [_printable(str(p)) for i, p in enumerate(raw)
               if not (p in ("one", "several") and i and raw[i - 1] == "train")]
        path = ".".join(loc).replace(".train.", ".train[", 1)
        if "train[" in path:  # data.train[1].weight
            index, _, rest = path.partition("train[")[2].partition(".")
            path = path.partition("train[")[0] + f"train[{index}]" + (f".{rest}" if rest else "")
        if problem["type"] == "extra_forbidden":
            message = f"unknown key '{loc[-1]}'"
            suggestion = _closest_key(loc)
            if suggestion:
                message += f" (did you mean '{suggestion}'?)"
        else:
            message = problem["msg"].removeprefix("Value error, ")
            if problem["type"] in ("literal_error", "enum"):
                message = f"{message}, got {_SHORT.repr(problem.get('input'))}"  # YAML aliases can nest huge values
        lines.append(f"{source}: {path}: {message}" if path else f"{source}: {message}")
    return "\n".join(lines)


def _printable(text: str) -> str:
    return text if text.isprintable() else repr(text)[1:-1]


def _closest_key(loc: list[str]) -> str | None:
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    matches = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.5)
    return matches[0] if matches else None

"""How a LoRA adapter starts, and LoRA+: the one home of `adapter.init` and `adapter.lora_plus_ratio`.

Every initialisation is peft's own (`LoraConfig.init_lora_weights`); this module says what each needs and costs,
which recipes it combines with (read by compat.py, the estimator and the docs), and keeps the saved adapter
usable on the base model as published:

- default   A random (Kaiming), B = 0: the adapter starts as a no-op.
- gaussian  A from a normal distribution scaled by 1/r, B = 0.
- pissa     A and B from the top-r singular vectors of each target weight W, which keeps the residual W - BA in
            place of W (the base weights change); converges faster than default on many tasks.
- olora     A and B from a QR decomposition of W; the base weights change the same way.
- eva       A from the top right-singular vectors of each target layer's inputs on the run's own training data
            (Paischer et al., 2024), B = 0, with ranks redistributed between layers by explained variance (peft's
            rho 2: a layer gets up to 2r, the total stays r per layer). The base is untouched. It runs forward passes
            over the first epoch's micro-batches as one process deals them, the same on every rank (no collective:
            any device, any backend), until the components converge (a bounded number of passes); the result is
            kept in the run directory (`eva_init.safetensors`) so that a resume starts from the very same adapter.
- corda     A and B from an SVD of W times the covariance of its inputs on the run's own data (Yang et al., 2024,
            peft's instruction-previewed mode): the directions the task uses, with the residual kept in place of W
            like PiSSA (saved converted the same way). The covariances (one in x in matrix per target, float32)
            come from the first CORDA_ROWS training rows of the first epoch, the same on every rank, one sample at a
            time (a packed row is split into its samples: peft's hook reads one sequence per call).

PiSSA and OLoRA move part of W into the adapter. An adapter trained from them applies to the residual base, not
to the published one, so it is saved converted (peft's `path_initial_model_for_weight_conversion`, done here on
the state dict): ΔW = BA - B0A0 = [B, -B0][A; A0], a rank-2r LoRA with the same scaling, which loads on the
published base like any adapter. The run keeps A0 and B0 (the adapter's size, on the CPU) for that.

LoRA+ (Hayou et al., 2024) trains B with a learning rate `lora_plus_ratio` times A's: the parameter groups are
the ones peft's `create_loraplus_optimizer` builds (lora_B and every 1-D trained weight in the B group, a LoRA
embedding's two factors at `lora_plus_lr_embedding`, no weight decay on B's biases and LayerNorm weights).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.base.errors import WorkbenchError
from workbench.spec.objectives import without_reference

if TYPE_CHECKING:
    import torch

INITS = ("default", "gaussian", "pissa", "olora", "eva", "corda")
# peft computes LoftQ on CUDA only (its loftq_utils pins the device), so no run here could check an init of ours
# against peft's own
LOFTQ_REFUSED = ("loftq is not offered: peft computes it on CUDA only; with QLoRA use default or gaussian, or pissa "
                 "on an unquantized base")
EVA_RHO = 2.0  # peft's default: a layer's rank may grow to rho x r as others shrink
EVA_FILE = "eva_init.safetensors"  # in the run directory: the components EVA chose, for a resume
# peft cycles the data until every layer converges: at most this many passes over the first epoch, or forward passes
# (a small data set converges by seeing its batches again)
EVA_PASSES, EVA_MIN_FORWARDS = 3, 200
CORDA_ROWS = 256  # calibration rows for CorDA's covariances (peft's guidance: ~256 samples of 2k tokens at width 4k)


@dataclass(frozen=True)
class Init:
    name: str
    peft_value: bool | str  # LoraConfig.init_lora_weights
    changes_base: bool  # the residual base replaces W: the saved adapter is converted
    decomposes: bool  # an SVD or QR of every target weight at start-up (time and a float32 copy of the weight)
    needs_data: bool = False  # computed from the training data's activations (forward passes at start-up)
    before_adapter: bool = False  # reads the data before the adapter exists (CorDA) rather than after (EVA)


TABLE = {
    "default": Init("default", True, changes_base=False, decomposes=False),
    "gaussian": Init("gaussian", "gaussian", changes_base=False, decomposes=False),
    "pissa": Init("pissa", "pissa", changes_base=True, decomposes=True),
    "olora": Init("olora", "olora", changes_base=True, decomposes=True),
    "eva": Init("eva", "eva", changes_base=False, decomposes=False, needs_data=True),
    "corda": Init("corda", "corda", changes_base=True, decomposes=True, needs_data=True, before_adapter=True),
}


def of(recipe) -> Init:
    return TABLE[recipe.adapter.init]


def recipe_problem(recipe) -> str | None:
    """Why the recipe's init (or LoRA+ ratio) cannot run, in one line naming the field; None when it can."""
    adapter = recipe.adapter
    init = of(recipe)
    if adapter.method == "full" and (adapter.init != "default" or adapter.lora_plus_ratio is not None):
        field = "adapter.init" if adapter.init != "default" else "adapter.lora_plus_ratio"
        return f"{field}: applies to LoRA adapters; method full trains every weight (remove it or choose lora)"
    if init.changes_base and recipe.training.has_reference:
        objective = recipe.training.objective
        return (f"adapter.init: {adapter.init} with objective {objective} is not supported: {objective.upper()}'s "
                "reference is the model with the adapter switched off, which after this init is the residual base, "
                "not the published model; use init default/gaussian"
                + without_reference(recipe.training.objective_spec))
    if init.changes_base and recipe.quantization is not None:
        return (f"adapter.init: {adapter.init} rewrites the base weights as a residual, which a quantized base "
                "cannot hold; use init default or gaussian with QLoRA")
    if init.changes_base and adapter.method == "dora":
        return (f"adapter.init: {adapter.init} with DoRA is not supported (the magnitude vector is computed from the "
                "weight the init rewrites); use method lora, or init default/gaussian with dora")
    if init.changes_base and adapter.modules_to_save:
        return (f"adapter.init: {adapter.init} with adapter.modules_to_save is not supported (the saved adapter is "
                "converted for the published base, and a module trained in full would keep the residual)")
    if init.needs_data and not init.before_adapter and adapter.method == "dora":
        return ("adapter.init: eva with DoRA is not supported (peft computes DoRA's magnitude before EVA replaces "
                "A); use method lora, or init default/gaussian with dora")
    return None


def peft_value(recipe) -> bool | str:
    return of(recipe).peft_value


def peft_options(recipe) -> dict:
    """What LoraConfig needs beside init_lora_weights for the recipe's init."""
    name = of(recipe).name
    if name == "eva":
        from peft import EvaConfig

        return {"eva_config": EvaConfig(rho=EVA_RHO)}
    if name == "corda":
        from peft.tuners.lora.config import CordaConfig

        return {"corda_config": CordaConfig(corda_method="ipm")}
    return {}


def preprocess_corda(model, config, rows) -> None:
    """peft's CorDA preprocessing on the base model: the covariance of each target's inputs over `rows` (dicts of
    input_ids and position_ids, one sample or packed row each: peft's hook reads one sequence at a time)."""
    import torch
    from peft.tuners.lora.corda import preprocess_corda as corda

    device = next(model.parameters()).device

    def run_model():
        for row in rows:
            for ids, positions in _samples_of(row):
                model(input_ids=torch.tensor([ids], device=device),
                      position_ids=torch.tensor([positions], device=device), use_cache=False)

    if config.target_modules == "all-linear":  # as get_peft_model expands it; CorDA's own matching takes names only
        # the head stays out: a language model's output embeddings, a classifier's score head (a reward model)
        heads = {id(model.get_output_embeddings())} | {id(module) for name, module in model.named_modules()
                                                       if name.rsplit(".", 1)[-1] in ("score", "classifier")}
        config.target_modules = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                                 if isinstance(module, torch.nn.Linear) and id(module) not in heads}
    with torch.no_grad():
        corda(model, config, run_model=run_model)


# -- EVA: from the training data ---------------------------------------------------------------------


def initialize_eva(model, batches, saved: dict | None = None) -> dict:
    """Run peft's EVA on `batches` (dicts of input_ids, position_ids and attention_mask, the same on every rank, so
    no rank waits for another), or load the components a run saved (`saved`). Returns the components, by layer,
    as saved in the run directory."""
    from peft import get_eva_state_dict, initialize_lora_eva_weights

    if saved is None:
        budget = limit = max(EVA_PASSES * len(batches), EVA_MIN_FORWARDS)

        def forward(model, inputs):
            nonlocal budget
            if budget == 0:
                raise WorkbenchError(f"adapter.init: eva did not converge within {limit} forward passes over the "
                                     "first epoch's micro-batches; raise "
                                     "training.micro_batch_size or data.max_seq_len, lower adapter.r, or choose "
                                     "another init")
            budget -= 1
            return _forward_packed(model, inputs)

        saved = get_eva_state_dict(model, dataloader=batches, forward_fn=forward, gather_distributed_inputs=False,
                                   show_progress_bar=False)
        saved = {name: u.detach().to("cpu").contiguous() for name, u in saved.items()}
    initialize_lora_eva_weights(model, eva_state_dict=dict(saved), show_progress_bar=False)
    return saved


def eva_problem(recipe, longest_batch_tokens: int) -> str | None:
    """peft's EVA skips a micro-batch with fewer real tokens than the components it computes (rho x r): one whose
    micro-batches are all that short would never converge."""
    needed = round(EVA_RHO * recipe.adapter.r)
    if longest_batch_tokens >= needed:
        return None
    return (f"adapter.init: eva computes {needed} components per layer (2 x adapter.r) from each micro-batch's "
            f"tokens, and this run's micro-batches hold at most {longest_batch_tokens}; raise "
            "training.micro_batch_size, turn data.packing on, or lower adapter.r")


def _samples_of(row: dict):
    """(input_ids, position_ids) of each sample of a packed row: a new one wherever positions start again at 0 (a
    preference pair holding its prompt once stays together: its answers continue the prompt's positions)."""
    ids, positions = row["input_ids"], row["position_ids"]
    starts = [i for i, p in enumerate(positions) if p == 0] or [0]
    for start, end in zip(starts, [*starts[1:], len(ids)]):
        yield ids[start:end], positions[start:end]


def _forward_packed(model, inputs):
    """The training forward: the attention mask only chooses which positions' inputs EVA reads; packed rows keep
    their samples apart by position_ids, as in training."""
    return model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False)


# -- the saved adapter ---------------------------------------------------------------------------------


@dataclass
class InitialAdapter:
    """A0 and B0 of every LoRA layer, by their state-dict names (the adapter's size, kept on the CPU)."""

    weights: dict[str, "torch.Tensor"]

    @classmethod
    def of(cls, model) -> "InitialAdapter":
        return cls({name: param.detach().to("cpu", copy=True) for name, param in model.named_parameters()
                    if ".lora_A." in name or ".lora_B." in name})

    def convert(self, state: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """The trained adapter's state dict as a rank-2r adapter of the published base: A' = [A; A0] and
        B' = [B, -B0], so that B'A' = BA - B0A0 (what training added to the published W)."""
        import torch

        converted = dict(state)
        initial = {_plain(name): tensor for name, tensor in self.weights.items()}
        for name, tensor in state.items():
            if ".lora_embedding_A." in name or ".lora_embedding_B." in name:
                # an embedding's base is left alone (peft starts its factors at A = 0 under every init): its delta
                # is BA, padded with zeros to the rank the converted config gives every layer
                start = torch.zeros_like(tensor)
            elif (start := initial.get(_plain(name))) is None:
                continue
            start = start.to(tensor.dtype)
            if ".lora_A." in name or ".lora_embedding_A." in name:
                converted[name] = torch.cat([tensor, start], dim=0)
            elif ".lora_B." in name or ".lora_embedding_B." in name:
                converted[name] = torch.cat([tensor, -start], dim=1)
        return converted


def _plain(name: str) -> str:
    """A LoRA weight's name as the saved state dict spells it (no wrapper prefixes, no adapter name)."""
    name = name.replace(".default.", ".")
    for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name[name.index("base_model."):] if "base_model." in name else name


def converted_config(config):
    """The saved adapter's LoraConfig: rank 2r, the same scaling, and an init that leaves the base alone."""
    import copy

    config = copy.deepcopy(config)
    config.r = 2 * config.r
    config.lora_alpha = config.lora_alpha * (math.sqrt(2) if config.use_rslora else 2)
    config.init_lora_weights = True
    return config


@contextmanager
def saving_converted(peft_model):
    """The model's adapter config as a converted init saves it, for the length of the save."""
    original = peft_model.peft_config["default"]
    peft_model.peft_config["default"] = converted_config(original)
    try:
        yield
    finally:
        peft_model.peft_config["default"] = original


# -- LoRA+ -------------------------------------------------------------------------------------------


def parameter_groups(model, recipe) -> list[dict]:
    """The optimizer's parameter groups: one at training.lr, and with LoRA+ the groups peft's
    `create_loraplus_optimizer` builds, each parameter at peft's rate and weight decay (training.weight_decay as
    its `loraplus_weight_decay`). Each group says its scale of training.lr (`lr_scale`) so a resume with a new lr
    keeps it; the embedding factors' scale is None: their rate is lora_plus_lr_embedding whatever training.lr."""
    lr, ratio, decay = recipe.training.lr, recipe.adapter.lora_plus_ratio, recipe.training.weight_decay
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if ratio is None:
        return [{"params": [p for _, p in trained], "lr": lr, "lr_scale": 1.0}]
    from peft.tuners.lora.layer import Embedding
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
    from transformers.trainer_pt_utils import get_parameter_names

    # peft's rule: no decay for a bias or a weight inside a LayerNorm (it asks only of B's group)
    decays = {name for name in get_parameter_names(model, ALL_LAYERNORM_LAYERS) if "bias" not in name}
    modules = dict(model.named_modules())
    # (lr, lr_scale, weight decay) by kind, in peft's order
    kinds = {"A": (lr, 1.0, decay), "embedding": (recipe.adapter.lora_plus_lr_embedding, None, decay),
             "B": (lr * ratio, ratio, decay), "B, no decay": (lr * ratio, ratio, 0.0)}
    members = {kind: [] for kind in kinds}
    for name, param in trained:
        # a LoRA embedding keeps its factors in dicts right below it (<layer>.lora_embedding_A.default): the layer
        # is two names up, as peft looks for it
        owner_name = ".".join(name.split(".")[:-2])
        owner = modules.get(owner_name) if owner_name else None
        if isinstance(owner, Embedding):
            kind = "embedding"
        elif "lora_B" in name or param.ndim == 1:
            kind = "B" if name in decays else "B, no decay"
        else:
            kind = "A"
        members[kind].append(param)
    return [{"params": members[kind], "lr": rate, "lr_scale": scale, "weight_decay": wd}
            for kind, (rate, scale, wd) in kinds.items() if members[kind]]


# -- what the estimator counts -----------------------------------------------------------------------


def startup_cost(recipe, shapes: list[tuple[int, int]]) -> dict:
    """The init's start-up work for target weights of these (out, in) shapes: floating-point operations (an SVD
    of an m x n matrix, about 4mn·min(m,n) + 8min(m,n)^3 at LAPACK's rates; a QR, 2mn·min) and the largest
    transient (a float32 copy of the weight and its factors), and the kept A0/B0 copy of a converted init."""
    init = of(recipe)
    if init.before_adapter and shapes:  # CorDA: every target's input covariance at once, and an SVD of each W·C
        flops = sum(4 * m * n * min(m, n) + 8 * min(m, n) ** 3 + 2 * m * n * n for m, n in shapes)
        kept = 4 * recipe.adapter.r * sum(m + n for m, n in shapes)
        return {"flops": int(flops), "transient_bytes": int(sum(4 * n * n for _, n in shapes)), "kept_bytes": kept}
    if init.needs_data and shapes:  # EVA: a micro-batch's inputs to the widest target layer, in float32, at a time
        widest = max(n for _, n in shapes)
        tokens = recipe.training.micro_batch_size * recipe.data.max_seq_len
        return {"flops": 0, "transient_bytes": int(4 * tokens * widest), "kept_bytes": 0}
    if not init.decomposes or not shapes:
        return {"flops": 0, "transient_bytes": 0, "kept_bytes": 0}
    flops, transient = 0, 0
    for m, n in shapes:
        k = min(m, n)
        flops += 2 * m * n * k if init.name == "olora" else 4 * m * n * k + 8 * k**3
        transient = max(transient, 4 * (m * n + m * k + k * n + k))
    kept = 4 * recipe.adapter.r * sum(m + n for m, n in shapes) if init.changes_base else 0
    return {"flops": int(flops), "transient_bytes": int(transient), "kept_bytes": int(kept)}

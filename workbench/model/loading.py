"""Load the tokenizer and base model a recipe names, quantize it if asked, and attach the adapter."""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch

from workbench.base.builtin import is_builtin, resolve_builtin
from workbench.base.errors import ModelError, escaped
from workbench.base.hub_reach import check_hub_answers
from workbench.base.metrics import full_numel
from workbench.hardware.current import current_device, local_kind
from workbench.hardware.precision import concrete, frozen_dtype_of, vocabulary_dtype
from workbench.model.attention import AUTO, resolve
from workbench.model import tensor_parallel
from workbench.model.lm_loss import CHUNK_ELEMENTS, plain_head
from workbench.spec import adapter_init
from workbench.spec.chat_templates import use_chat_template
from workbench.spec.model_configs import checkpoint_files, describe_model, target_modules
from workbench.spec.recipe import ModelSection, Recipe
from workbench.spec.rope_scaling import scaled_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_model_path(path: str) -> str:
    """A builtin name becomes its cached folder; a local folder stays; anything else is a hub id, and the hub
    must answer within its wait (the id is loaded next)."""
    if is_builtin(path):
        return str(resolve_builtin(path))
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise ModelError(f"model.path: {escaped(local)} has no config.json (not a transformers model folder)")
        return str(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ModelError(f"model.path: {escaped(path)} does not exist (and is not a hub id of the form owner/name)")
    check_hub_answers(path, "model", "model.path", ModelError)  # a hub that never answers: named in seconds
    return path


def _hub_call(path: str, what: str, load):
    try:
        return load()
    except OSError as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = "the hub is offline (HF_HUB_OFFLINE=1)" if offline else "no network or no such repository"
        raise ModelError(f"model.path: cannot load the {what} of '{escaped(path)}' from the hub: {hint} "
                         f"({err})") from None


def load_tokenizer(model: ModelSection, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (data.chat_template) in place of its own template."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model.path)
    tokenizer = _hub_call(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(
        path, revision=model.revision, trust_remote_code=model.trust_remote_code))
    if tokenizer.pad_token is None:
        # Padding positions never carry loss, so reusing EOS as pad is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return use_chat_template(tokenizer, chat_template)


def load_config(model: ModelSection):
    from transformers import AutoConfig

    path = resolve_model_path(model.path)
    config = _hub_call(path, "config", lambda: AutoConfig.from_pretrained(
        path, revision=model.revision, trust_remote_code=model.trust_remote_code))
    return scaled_config(config, model)


def model_class(recipe: Recipe):
    """The transformers auto class a run trains: a causal LM, or for a reward model (training.objective: reward)
    the sequence classifier with one output, its `score` head in place of the LM head."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if recipe.training.scores_sequences else AutoModelForCausalLM


def reward_config(recipe: Recipe, config=None):
    """The base's config for a reward model: one label (the scalar reward) and the tokenizer's pad token, which
    the classifier's own pooling needs (the workbench reads each answer's last token itself: objectives.Reward)."""
    config = config if config is not None else load_config(recipe.model)
    config.num_labels = 1
    config.pad_token_id = load_tokenizer(recipe.model, recipe.data.chat_template).pad_token_id
    return config


def load_base_model(recipe: Recipe, device_map=None, tp_size: int = 1):
    """The frozen base model in the recipe's dtype (4/8-bit quantized for qlora); for a reward model the sequence
    classifier over it, its score head drawn from the seed set before (the LM head is not read). `tp_size`: the
    processes it is split over for tensor parallel (model/tensor_parallel.py)."""
    recipe = concrete(recipe)
    path = resolve_model_path(recipe.model.path)
    attn = recipe.model.attn
    if attn == AUTO:  # a model loaded outside a run (chat, evaluate, merge): what a run here would use
        attn = resolve(recipe, local_kind()).implementation
    kwargs = dict(
        dtype=DTYPES[recipe.model.dtype],
        attn_implementation=attn,
        revision=recipe.model.revision,
        trust_remote_code=recipe.model.trust_remote_code,
    )
    if recipe.quantization is not None:
        kwargs["quantization_config"] = bnb_config(recipe)
        from transformers.integrations import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():  # ZeRO-3 places (and partitions) the weights itself
            kwargs["device_map"] = device_map or {"": current_device()}
    elif device_map is not None:
        kwargs["device_map"] = device_map
    if recipe.model.rope_scaling is not None:
        kwargs["config"] = load_config(recipe.model)
    if recipe.training.scores_sequences:
        kwargs["config"] = reward_config(recipe, kwargs.get("config"))
    if tp_size > 1:  # transformers splits each weight as it loads it
        kwargs.update(tensor_parallel.load_options(tp_size))
        return _hub_call(path, "weights", lambda: model_class(recipe).from_pretrained(path, **kwargs))
    streamed = read_without_mapping(path, recipe, kwargs)
    if streamed is not None:
        return streamed
    return _hub_call(path, "weights", lambda: model_class(recipe).from_pretrained(path, **kwargs))


def read_without_mapping(path: str, recipe: Recipe, kwargs: dict):
    """A local safetensors checkpoint loaded tensor by tensor with plain reads instead of a memory map, or None
    where that cannot apply (hub ids, remote code, ZeRO-3's own loading, other file layouts, an older
    safetensors). transformers maps the whole checkpoint and keeps it mapped until every weight is in place,
    so the file's pages count in the process's memory beside the weights made from them: a QLoRA load of a
    1.24B model (2.5 GB in bf16) peaked at 4.4 GB for 1.8 GB of 4-bit weights. Read this way it holds one
    tensor of the file at a time (2.1 GB; a float32 LoRA load: 7.4 -> 5.1 GB). Same weights, same code path in
    transformers (its documented `state_dict` argument), bit-identical logits."""
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, GenerationConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    folder = Path(path)
    files = checkpoint_files(folder) if folder.is_dir() else None
    if not files or recipe.model.trust_remote_code or is_deepspeed_zero3_enabled():
        return None
    config = kwargs.get("config") or AutoConfig.from_pretrained(folder)
    cls = model_class(recipe)._model_mapping.get(type(config), None)
    if cls is None:
        return None
    handles = []
    try:
        for file in files:
            try:
                handles.append(safe_open(file, framework="pt", device="cpu", backend="pread"))
            except TypeError:  # a safetensors without plain reads
                return None
            except (SafetensorError, OSError) as err:
                raise ModelError(f"model.path: {escaped(file)} is not a readable safetensors file ({err})") from None
        weights = {name: handle.get_slice(name) for handle in handles for name in handle.keys()}
        try:
            model = cls.from_pretrained(None, state_dict=weights, **{**kwargs, "config": config})
        except (SafetensorError, OSError) as err:
            names = ", ".join(str(f) for f in files)
            raise ModelError(f"model.path: reading the weights failed ({err}) in {names}") from None
    finally:
        for handle in handles:
            handle.__exit__(None, None, None)
    model.config.name_or_path = model.name_or_path = path  # what peft records as the adapter's base
    if (folder / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def bnb_config(recipe: Recipe):
    from transformers import BitsAndBytesConfig

    q = concrete(recipe).quantization
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
        bnb_4bit_quant_storage=getattr(torch, q.quant_storage),
    )


def attach_adapter(model, recipe: Recipe, calibration=None):
    """Wrap the base model for training: a PEFT adapter, or every weight trainable for `full`. `calibration`: the
    rows an init that reads the data before the adapter exists (CorDA) computes from."""
    adapter = recipe.adapter
    if recipe.training.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs and needs no input-grad hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if adapter.method == "full":
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    if recipe.quantization is not None:
        prepare_quantized(model, recipe)
    config = LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=target_modules(adapter),
        use_rslora=adapter.rslora,
        use_dora=adapter.method == "dora",
        modules_to_save=adapter.modules_to_save,
        init_lora_weights=adapter_init.peft_value(recipe),
        # a reward model's score head trains whole beside the adapter (peft adds it to modules_to_save)
        task_type="SEQ_CLS" if recipe.training.scores_sequences else "CAUSAL_LM",
        **adapter_init.peft_options(recipe),
    )
    if adapter_init.of(recipe).before_adapter:
        adapter_init.preprocess_corda(model, config, calibration)
    drawn_from = torch.get_rng_state()  # what peft's initialisation draws from
    try:
        model = get_peft_model(model, config)
    except ValueError as err:
        raise ModelError(f"adapter.target_modules: {err}") from None
    if tensor_parallel.is_split(model):
        tensor_parallel.check_targets(model)
        tensor_parallel.global_lora_features(model)
        tensor_parallel.draw_as_one_process(model, drawn_from, config.init_lora_weights)
    # peft makes LoRA weights float32 but copies a modules_to_save module in the base's dtype: AdamW on 16-bit
    # weights loses small updates. Under autocast a float32 copy computes in 16 bit like the rest (without
    # it, a float32 copy between 16-bit layers could not run: pure 16-bit training stays as asked).

    if concrete(recipe).training.mixed_precision != "no":
        for param in model.parameters():
            if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.to(torch.float32)
    return model


def prepare_quantized(model, recipe: Recipe) -> None:
    """What a quantized base needs before its adapter: every weight frozen, and the weights left unquantized kept
    in the dtype precision.frozen_dtype_of chooses. peft's prepare_model_for_kbit_training would also cast them
    to float32: for a 128k vocabulary that is 2 GiB more for the embeddings and head of an 8B model, and the
    residual stream in float32 besides. (Non-reentrant gradient checkpointing, enabled above, needs no
    input-gradient hooks.)"""
    recipe = concrete(recipe)
    model.requires_grad_(False)
    if frozen_dtype_of(recipe) != "float32":
        return  # as loaded (a model's own float32 modules, if any, stay float32)
    for param in model.parameters():  # 4-bit weights stored as bfloat16 (quant_storage) stay packed
        if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit":
            param.data = param.data.to(torch.float32)
    vocabulary = vocabulary_dtype(recipe, describe_model(recipe.model.path, recipe.model.revision,
                                                         recipe.model.trust_remote_code))
    if vocabulary != "float32":
        keep_vocabulary_16bit(model, DTYPES[vocabulary])


def keep_vocabulary_16bit(model, dtype: torch.dtype) -> bool:
    """Frozen input embeddings (and an untied head) stored in 16 bits while the model computes in float32
    (precision.vocabulary_dtype_of): lookups are cast back to float32, exactly; the training loss runs the head
    itself (lm_loss casts it a slice at a time); where the model's own head runs (evaluation's full logits,
    sample generations) it casts its weight a slice of the vocabulary at a time. False (nothing changed) when
    the head is not a plain Linear the loss can stand in for."""
    embeddings, head = model.get_input_embeddings(), plain_head(model)
    if head is None or type(embeddings) is not torch.nn.Embedding:  # not a subclass that scales in its dtype
        return False
    compute = embeddings.weight.dtype
    for module in {id(m): m for m in (embeddings, head[1])}.values():
        module.weight.data = module.weight.data.to(dtype)
    embeddings.register_forward_hook(lambda module, args, output: output.to(compute))
    head[1].forward = types.MethodType(_head_in_slices, head[1])
    return True


def _head_in_slices(self, hidden: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward with a 16-bit weight cast to the input's dtype a slice of the vocabulary at a time."""
    if self.weight.dtype == hidden.dtype:
        return torch.nn.functional.linear(hidden, self.weight)
    step = max(1, CHUNK_ELEMENTS // self.in_features)
    return torch.cat([torch.nn.functional.linear(hidden, self.weight[i:i + step].to(hidden.dtype))
                      for i in range(0, self.out_features, step)], dim=-1)


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable) parameter counts of the whole model, whatever this process holds of it."""
    total = trainable = 0
    for param in model.parameters():
        n = full_numel(param)
        total += n
        if param.requires_grad:
            trainable += n
    return total, trainable

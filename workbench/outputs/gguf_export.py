"""Export a run (its adapter merged into the base) or a model folder as one GGUF file, for llama.cpp, Ollama
and LM Studio, with an Ollama Modelfile beside it.

Written with the `gguf` package alone, the way llama.cpp's convert_hf_to_gguf.py writes a Llama model: the
same tensor names, q/k row order, metadata keys, tokenizer fields and file types.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np

from workbench.base.builtin import is_builtin, resolve_builtin
from workbench.base.errors import ModelError, RecipeError, WorkbenchError, WriteError, escaped
from workbench.base.quiet import leaves_the_process_as_found, quiet_libraries
from workbench.model.inference import check_adapter
from workbench.model.loading import load_config
from workbench.outputs.merging import merge
from workbench.rundir.runs import load_run
from workbench.rundir.staging import merge_staging_folder, remove_leftovers
from workbench.spec.chat_templates import render as render_template

# quant name -> (the type of every weight matrix, the file type the header announces)
QUANTS = {
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
ARCHITECTURES = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA}
FORMATS = ("gguf",)
ROPE_TYPES = (None, "default", "linear", "llama3")

# The pre-tokenizer regexes llama.cpp knows by name (tokenizer.ggml.pre), as tokenizer.json spells them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_NAMES = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


# -- the public entry points ------------------------------------------------------------------


def export(source: str | Path, format: str = "gguf", quant: str = "f16", out: str | Path | None = None) -> Path:
    """Export a run's tuned model (its adapter merged into the base), or a model folder or builtin:NAME, for
    local inference. `format="gguf"` writes one .gguf file (quant f16, f32 or q8_0) for llama.cpp, Ollama and
    LM Studio, and an Ollama Modelfile beside it. Returns the file.

    Default `out`: RUN/gguf/RUN_NAME-QUANT.gguf for a run, ./gguf/NAME-QUANT.gguf for a model.
    """
    if format not in FORMATS:
        raise RecipeError(f"--format: must be one of {', '.join(FORMATS)}, got {format!r}")
    return export_gguf(source, out=out, quant=quant)


@leaves_the_process_as_found
def export_gguf(source: str | Path, out: str | Path | None = None, quant: str = "f16") -> Path:
    """Write `source` (a run directory, a model folder or builtin:NAME) as a GGUF file; see `export`."""
    quiet_libraries()
    check_quant(quant)
    if out is not None and not str(out).strip():
        raise RecipeError("--out: empty; name a .gguf file or leave it out for the default")
    out = Path(out).expanduser() if out is not None else None
    if (Path(source).expanduser() / "run.json").exists():
        source = Path(source).expanduser()
        run = load_run(source)
        out = Path(out) if out else run.path / "gguf" / f"{run.name}-{quant}.gguf"
        check_out(out, run.path)
        if run.checked_recipe().training.scores_sequences:
            raise WorkbenchError(f"{escaped(run.path)}: a reward model (training.objective: reward) has a score "
                                 f"head, not the "
                                 "LM head a GGUF runtime generates with; `workbench merge` writes it as a "
                                 "transformers sequence classifier")
        check_architecture(run.path, _run_model_config(run))
        check_writable(out)
        with new_folders_removed_on_failure(out.parent), writing(out), merged_run(run, out) as folder:
            return write_gguf(folder, out, quant, name=run.name, source=str(run.path))
    folder, name = local_model(source)
    out = Path(out) if out else Path("gguf") / f"{name}-{quant}.gguf"
    check_out(out, None)
    check_architecture(source, _config(folder))
    check_writable(out)
    with new_folders_removed_on_failure(out.parent), writing(out):
        return write_gguf(folder, out, quant, name=name,
                          source=str(source) if str(source).startswith("builtin:") else str(folder.resolve()))


# -- checks, before anything slow -------------------------------------------------------------


def check_quant(quant: str) -> None:
    if quant not in QUANTS:
        raise RecipeError(f"--quant: must be one of {', '.join(QUANTS)}, got {quant!r}")


RUN_PARTS = ("adapter", "model", "merged", "checkpoints")  # what a run saves; push uploads the first three


def check_out(out: Path, run_path: Path | None) -> None:
    """A .gguf file path. What exists there, and the Modelfile beside it, is replaced only when an earlier export
    wrote it (recorded inside each: see `is_earlier_export`); nothing else is, the run's own files least of all."""
    target = out.resolve()
    replaceable = target.is_file() and target.suffix == ".gguf" and is_earlier_export(target)
    if run_path is not None and target.exists() and not replaceable and target.is_relative_to(run_path.resolve()):
        raise WorkbenchError(f"--out: {escaped(out)} already exists inside the run {escaped(run_path)}; name a new "
                             f".gguf file")
    if run_path is not None and any(target.is_relative_to(run_path.resolve() / part) for part in RUN_PARTS):
        raise WorkbenchError(f"--out: {escaped(out)} is inside the run's {'/'.join(RUN_PARTS)} folders (saved and "
                             "pushed as they are); the default is RUN/gguf/")
    if out.suffix != ".gguf":
        raise RecipeError(f"--out: must be a path ending in .gguf, got {escaped(out)}")
    check_replaceable(out)


def check_replaceable(out: Path) -> None:
    """Refuse to replace a file at `out` or a Modelfile beside it that an earlier export did not write. Checked
    before any work and again just before the files are put in place."""
    if (out.exists() or out.is_symlink()) and not is_earlier_export(out):
        raise WorkbenchError(f"--out: {escaped(out)} exists and was not written by workbench export (only its own "
                             "exports are replaced); name a new .gguf file")
    modelfile = out.with_name("Modelfile")
    if (modelfile.exists() or modelfile.is_symlink()) and not is_our_modelfile(modelfile):
        raise WorkbenchError(f"--out: {modelfile} exists and was not written by workbench export (or was edited "
                             "since); export into another folder, or move it")


# Written into every exported GGUF: the mark of a file that a later export may replace (its value: the name), and
# what it was exported from (a run directory, a model folder, builtin:NAME), which a replacement names.
EXPORT_KEY = "lora_workbench.export"
SOURCE_KEY = "lora_workbench.source"


def is_earlier_export(path: Path) -> bool:
    """Whether `path` is a GGUF file this workbench wrote (its metadata holds EXPORT_KEY)."""
    try:
        if path.is_symlink() or not path.is_file():
            return False
        with path.open("rb") as handle:
            if handle.read(4) != b"GGUF":
                return False
        return EXPORT_KEY in gguf.GGUFReader(path).fields
    except Exception:  # a damaged or foreign file fails in the reader in many ways; none of them is ours
        return False


# The first line of every Modelfile an export writes; the hash is that of the lines after it, so a Modelfile the
# user edited (a SYSTEM line, a PARAMETER) is never replaced.
MODELFILE_MARK = "# Written by workbench export (replaced by the next export into this folder unless edited) sha256:"


def is_our_modelfile(path: Path) -> bool:
    try:
        if path.is_symlink() or not path.is_file():
            return False
        first, _, rest = path.read_text(encoding="utf-8").partition("\n")
    except (OSError, ValueError):
        return False
    return first == MODELFILE_MARK + hashlib.sha256(rest.encode("utf-8")).hexdigest()


def check_writable(out: Path) -> None:
    """The output's folder (or the nearest one that exists) takes a file: a read-only folder fails here, in
    seconds, not after the merge."""
    folder = out.parent.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{out.name}.{os.getpid()}.probe", suffix=".tmp"):
            pass
    except OSError as err:
        raise WorkbenchError(f"--out: cannot write {escaped(out)} ({err.strerror or err})") from None


@contextmanager
def writing(out: Path, every_error: bool = False):
    """An error writing the export's temporary files (in the output's folder) names the user's path, not the
    temporary one; with every_error, so does any OSError (a full disk names no file)."""
    try:
        yield
    except OSError as err:
        mine = err.filename is not None and Path(err.filename).absolute().is_relative_to(out.parent.absolute())
        if not (mine or every_error):
            raise
        raise WorkbenchError(f"--out: cannot write {escaped(out)} ({err.strerror or err})") from None


@contextmanager
def new_folders_removed_on_failure(folder: Path):
    """The folders made for the output (`folder` and any missing parents) are removed again if the export fails."""
    missing, path = [], folder.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    try:
        yield
    except BaseException:
        for path in missing:  # the deepest first; one that is not empty stops it
            try:
                path.rmdir()
            except OSError:
                break
        raise


def architecture_of(config) -> str:
    names = getattr(config, "architectures", None)
    return names[0] if names else {"llama": "LlamaForCausalLM"}.get(config.model_type, config.model_type)


def check_architecture(source, config) -> None:
    architecture = architecture_of(config)
    if architecture not in ARCHITECTURES:
        raise WorkbenchError(f"{escaped(source)}: GGUF export supports {', '.join(ARCHITECTURES)} "
                             f"(Llama-architecture) models "
                             f"only; this model is {architecture} (model_type {config.model_type!r})")
    rope_type = _rope(config).get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise WorkbenchError(f"{escaped(source)}: GGUF export supports rope types "
                             f"{', '.join(map(str, ROPE_TYPES[1:]))}; "
                             f"this model uses {rope_type!r}")


def local_model(source: str | Path) -> tuple[Path, str]:
    """(folder, name) of a model folder or builtin:NAME; hub ids are refused (merge or download them first)."""
    text = str(source)
    if is_builtin(text):
        return resolve_builtin(text), text.removeprefix("builtin:")
    folder = Path(text).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelError(f"{escaped(source)}: neither a run directory (run.json) nor a model folder (config.json); "
                         "export takes one of those or builtin:NAME")
    return folder, folder.resolve().name


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _run_model_config(run):
    """The config of the model a run tunes: its saved full model, or the base its adapter applies to."""
    if run.dir.model.exists():
        return _config(run.dir.model)
    check_adapter(run.path, run.adapter_dir)

    return load_config(run.checked_recipe().model)  # with the run's model.rope_scaling, as it trained


@contextmanager
def merged_run(run, out: Path):
    """The run's tuned model as a plain transformers folder, merged in float32 (no rounding before the
    export's own), in a temporary folder beside the output: the system temp folder may be too small."""
    staging = merge_staging_folder(out.parent)
    try:
        try:
            merged = merge(run.path, out=staging / "model", dtype="float32")
        except WriteError as err:  # it names the temporary folder, which is no path of the user's
            raise WriteError(f"--out: {escaped(out)}", err.cause) from None
        yield merged
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# -- writing the file -------------------------------------------------------------------------


def write_gguf(folder: Path, out: Path, quant: str, name: str, source: str | None = None) -> Path:
    """Write the model folder as `out`, through a temporary name, and the Modelfile beside it. Replacing an
    earlier export, or a Modelfile written for another GGUF of the folder, is said in one line each."""
    from transformers import AutoTokenizer

    config = _config(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tensor_type, file_type = QUANTS[quant]
    arch = ARCHITECTURES[architecture_of(config)]
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    add_model_metadata(writer, config, name, file_type)
    writer.add_string(SOURCE_KEY, source if source is not None else name)
    add_tokenizer(writer, folder, tokenizer, config.vocab_size)
    for gguf_name, data in gguf_tensors(folder, config, arch):
        stored = _stored_type(gguf_name, data, tensor_type)
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, stored), raw_dtype=stored)

    modelfile = modelfile_text(out, tokenizer, _generation_config(folder))

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out.parent)
    writer_id = f"{os.getpid()}.{threading.get_ident()}"  # one staging name per writer
    staging = out.with_name(f".{out.name}.{writer_id}.tmp")
    staged_modelfile = out.with_name(f".{out.name}.Modelfile.{writer_id}.tmp")
    try:
        with writing(out, every_error=True):
            writer.write_header_to_file(path=staging)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            staged_modelfile.write_text(modelfile, encoding="utf-8")
            check_replaceable(out)  # again: a file may have been put there while the model was merged
            notices = replacement_notices(out)
            os.replace(staging, out)  # a crash never leaves a half-written .gguf under the final name
            os.replace(staged_modelfile, out.with_name("Modelfile"))
    finally:
        staging.unlink(missing_ok=True)
        staged_modelfile.unlink(missing_ok=True)
    for notice in notices:
        warnings.warn(notice, stacklevel=3)
    return out


def replacement_notices(out: Path) -> list[str]:
    """What putting the export at `out` replaces besides nothing: an earlier export at that path (named by what it
    was exported from), and the folder's Modelfile when it was written for another GGUF (which stays)."""
    notices = []
    if out.exists():
        source, quant = export_record(out)
        notices.append(f"replaced {escaped(out)}, an earlier export of {escaped(source)} ({quant})")
    modelfile = out.with_name("Modelfile")
    if modelfile.exists():
        body = modelfile.read_text(encoding="utf-8").partition("\n")[2]
        earlier = body.partition("\n")[0].removeprefix("FROM ./")
        if earlier != out.name:
            notices.append(f"{modelfile} now points to {out.name}; it pointed to {earlier}, which stays (set FROM "
                           "back to it to create an Ollama model from that file)")
    return notices


def export_record(path: Path) -> tuple[str, str]:
    """(what an earlier export was exported from, its quant), as its metadata records them."""
    try:
        fields = gguf.GGUFReader(path).fields
        source = fields[SOURCE_KEY if SOURCE_KEY in fields else EXPORT_KEY].contents()
        file_type = fields["general.file_type"].contents() if "general.file_type" in fields else None
    except Exception:  # checked to be an export just before; a reader that fails now names it as unknown
        return "an unknown source", "unknown quant"
    quant = next((name for name, (_, kind) in QUANTS.items() if kind == file_type), f"file type {file_type}")
    return str(source), quant


def add_model_metadata(writer, config, name: str, file_type) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = _rope(config)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_string(EXPORT_KEY, name)  # what lets a later export replace this file (is_earlier_export)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _rope(config) -> dict:
    """rope_theta, rope_type and scaling in one dict (transformers 5 keeps them in rope_parameters)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type"))
    return params


# -- tensors ----------------------------------------------------------------------------------


def gguf_tensors(folder: Path, config, arch):
    """(GGUF name, float32 array) for every weight, read one at a time from the folder's safetensors."""
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    yield from _rope_factors(config)
    for part in sorted(folder.glob("*.safetensors")):
        with safe_open(part, framework="pt") as tensors:
            for name in tensors.keys():
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue  # recomputed at load time / the same matrix as the embeddings
                gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise WorkbenchError(f"{folder}: no GGUF name for the tensor {name}")
                data = tensors.get_tensor(name).float()
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    data = llama_cpp_rope_order(data, heads)
                elif name.endswith(("k_proj.weight", "k_proj.bias")):
                    data = llama_cpp_rope_order(data, kv_heads)
                yield gguf_name, data.numpy()


def llama_cpp_rope_order(weights, heads: int):
    """Reorder q/k rows within each head from transformers' rotate-half RoPE layout (first half of a head
    pairs with its second half) to the interleaved one llama.cpp's Llama computes (row 2i pairs with 2i+1).
    transformers' GGUF loader applies the inverse when it reads the file back."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _rope_factors(config):
    """Llama 3.1's frequency scaling, which llama.cpp reads as a tensor (rope_freqs.weight)."""
    rope = _rope(config)
    if rope.get("rope_type") != "llama3":
        return
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", np.array(factors, dtype=np.float32)


def _stored_type(gguf_name: str, data: np.ndarray, tensor_type):
    """Norms and other vectors stay float32, as llama.cpp needs; a matrix whose rows do not split into Q8_0's
    blocks of 32 is stored as F16 instead, as llama.cpp's converter does."""
    if data.ndim <= 1 or gguf_name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[tensor_type]
    if data.shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return tensor_type


# -- the tokenizer ----------------------------------------------------------------------------


def add_tokenizer(writer, folder: Path, tokenizer, vocab_size: int) -> None:
    """The vocabulary, merges, special ids and chat template in llama.cpp's byte-level BPE ("gpt2") form."""
    spec = _tokenizer_json(folder)
    tokens, token_types = vocabulary(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges(spec["model"]["merges"]))
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id")
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(adds_special(tokenizer, "bos"))
    writer.add_add_eos_token(adds_special(tokenizer, "eos"))
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates
        template = [{"name": name, "template": text} for name, text in template.items()]
    if template:
        writer.add_chat_template(template)


def adds_special(tokenizer, kind: str) -> bool:
    """Whether encoding text puts the BOS (EOS) token before (after) it: llama.cpp must do the same."""
    token_id = getattr(tokenizer, f"{kind}_token_id")
    ids = tokenizer("a")["input_ids"]
    return token_id is not None and (ids[:1] if kind == "bos" else ids[-1:]) == [token_id]


def _tokenizer_json(folder: Path) -> dict:
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    model = spec.get("model", {})
    byte_level = "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    if model.get("type") != "BPE" or model.get("byte_fallback") or not byte_level:
        raise WorkbenchError(f"{folder}: GGUF export supports byte-level BPE tokenizers (a GPT-2 or Llama-3 style "
                             "tokenizer.json); this model's tokenizer is not one")
    return spec


def vocabulary(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """One token per embedding row, with llama.cpp's token types; rows no token uses are marked unused."""
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise WorkbenchError(f"the tokenizer has token id {max(by_id)} but the model only {vocab_size} embeddings")
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(token)
            control = added[index].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def merges(pairs: list) -> list[str]:
    """llama.cpp stores a merge as "left right"; a space inside a part is spelled as its byte-level character."""
    if pairs and isinstance(pairs[0], str):
        return list(pairs)
    return [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in pairs]


def pre_tokenizer_name(pre: dict | None) -> str:
    """The tokenizer.ggml.pre name under which llama.cpp splits text the way this tokenizer.json does."""
    parts = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre or {}]
    kinds = [part.get("type") for part in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"  # llama.cpp: single digits, then the GPT-2 regex
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        name = SPLIT_NAMES.get(parts[0].get("pattern", {}).get("Regex"))
        if name:
            return name
    warnings.warn(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}) has no llama.cpp name; the GGUF "
                  "says 'default', so llama.cpp may split some text differently than transformers", stacklevel=2)
    return "default"


# -- the Ollama Modelfile ---------------------------------------------------------------------


def _generation_config(folder: Path):
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").exists() else None


def write_modelfile(gguf_path: Path, tokenizer, generation) -> Path:
    """`ollama create NAME -f Modelfile`: the file, its chat template in Go syntax, and every stop token."""
    path = gguf_path.with_name("Modelfile")
    path.write_text(modelfile_text(gguf_path, tokenizer, generation), encoding="utf-8")
    return path


def modelfile_text(gguf_path: Path, tokenizer, generation) -> str:
    lines = [f"FROM ./{gguf_path.name}"]
    template = ollama_template(tokenizer)
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    elif tokenizer.chat_template:
        lines += ["# The chat template has no Go translation here: Ollama uses the one embedded in the GGUF",
                  "# (tokenizer.chat_template) when it recognises it; write a TEMPLATE here if it does not."]
    for text in stop_texts(tokenizer, generation):
        lines.append(f"PARAMETER stop {json.dumps(text, ensure_ascii=False)}")
    body = "\n".join(lines) + "\n"
    return f"{MODELFILE_MARK}{hashlib.sha256(body.encode('utf-8')).hexdigest()}\n{body}"


def stop_texts(tokenizer, generation) -> list[str]:
    """The tokenizer's EOS and the generation config's EOS ids, as text."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(generation, "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in dict.fromkeys(ids) if i is not None]
    return [text for text in dict.fromkeys(texts) if text]


# Marker contents for probing a chat template: plain words that no template trims or rewrites.
_SYSTEM, _USER, _ASSISTANT, _USER2 = "SYSTEMxMARKER", "USERxMARKER", "ASSISTANTxMARKER", "SECONDxMARKER"


def ollama_template(tokenizer) -> str | None:
    """The chat template in Ollama's Go syntax, or None when it is not of the common regular shape.

    Rather than parse Jinja, render probe conversations and read off what goes around each role's content
    (ChatML, Llama 3 and the like wrap every message the same way); a multi-turn conversation rendered both
    ways must agree, or the template is left untranslated.
    """
    if not tokenizer.chat_template or isinstance(tokenizer.chat_template, dict):
        return None
    try:
        parts = _template_parts(tokenizer)
    except Exception:  # a template that refuses a probe (unknown roles, a raise_exception) or runs past its budget
        return None
    if parts is None or any(s in text for text in parts.values() for s in ("{{", "}}", '"""')):
        return None
    system = "{{ if .System }}" + parts["system_prefix"] + "{{ .System }}" + parts["system_suffix"]
    system += ("{{ else }}" + parts["default_system"] if parts["default_system"] else "") + "{{ end }}"
    messages = ('{{ range .Messages }}{{ if eq .Role "user" }}' + parts["user_prefix"] + "{{ .Content }}"
                + parts["user_suffix"] + '{{ else if eq .Role "assistant" }}' + parts["assistant_prefix"]
                + "{{ .Content }}" + parts["assistant_suffix"] + "{{ end }}{{ end }}")
    return system + messages + parts["generation_prompt"]


def _template_parts(tokenizer) -> dict | None:
    def render(*turns, prompt=False):
        messages = [{"role": role, "content": content} for role, content in turns]
        text = render_template(tokenizer, messages, add_generation_prompt=prompt)  # within the budget: it is code
        return text.removeprefix(tokenizer.bos_token) if adds_bos else text  # the runtime adds BOS itself

    adds_bos = adds_special(tokenizer, "bos")

    system, user, assistant, user2 = ("system", _SYSTEM), ("user", _USER), ("assistant", _ASSISTANT), ("user", _USER2)
    rendered = [render(system), render(system, user), render(system, user, assistant),
                render(system, user, assistant, user2), render(system, user, assistant, user2, prompt=True)]
    if not all(longer.startswith(shorter) for shorter, longer in zip(rendered, rendered[1:])):
        return None
    system_block, user_block, assistant_block, user2_block, generation_prompt = (
        rendered[0], *(longer[len(shorter):] for shorter, longer in zip(rendered, rendered[1:])))
    if user2_block != user_block.replace(_USER, _USER2):
        return None
    without_system = render(user, assistant, user2, prompt=True)
    tail = user_block + assistant_block + user2_block + generation_prompt
    if not without_system.endswith(tail):
        return None
    blocks = {"system": (system_block, _SYSTEM), "user": (user_block, _USER),
              "assistant": (assistant_block, _ASSISTANT)}
    parts = {"default_system": without_system[:-len(tail)], "generation_prompt": generation_prompt}
    for role, (block, marker) in blocks.items():
        if block.count(marker) != 1:
            return None
        parts[f"{role}_prefix"], parts[f"{role}_suffix"] = block.split(marker)
    return parts

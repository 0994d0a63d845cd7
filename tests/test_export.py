"""From adapter to use: merge, evaluate, chat, and the tuned model against its base."""

import io
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from workbench import Recipe, WorkbenchError, generate, train
from workbench.base.errors import ModelError, RecipeError
from workbench.model.inference import load_for_inference
from workbench.outputs.evaluation import evaluate, format_evaluation, greedy_answers
from workbench.outputs.merging import merge

ROOT = os.getcwd()  # conftest moved us to the project root
PROMPTS = ["Tell me a short story.", "What is 12 plus 13?", "Repeat the word stone three times.",
           "Please summarise the following text in one sentence: the quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny LoRA run (20 steps, seconds) shared by the tests below, which only read it."""
    out = tmp_path_factory.mktemp("runs")
    recipe = Recipe.load("recipes/tiny.yaml").override(
        f"output.dir={out}/{{name}}", "output.save_every=null", "output.eval_every=null", "training.threads=1",
        "model.dtype=float32", "training.mixed_precision=no")  # merged logits are compared to 1e-5
    return train(recipe, progress_bar=False)


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


# -- merge --------------------------------------------------------------------------------------


def test_merged_model_equals_base_plus_adapter_and_loads_without_peft(tiny_run, tmp_path):
    out = merge(tiny_run.run_dir, out=tmp_path / "merged", dtype="float32")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    assert not (tmp_path / "merged.tmp").exists()

    tuned, tokenizer = load_for_inference(tiny_run.run_dir, device="cpu")  # base + PEFT adapter, fp32
    ids = torch.arange(3, 60).unsqueeze(0)
    expected = logits_of(tuned, ids)
    torch.save(ids, tmp_path / "ids.pt")
    conversation = [{"role": "user", "content": "What is 2 plus 2?"}]

    # A fresh interpreter where `import peft` fails: the merged folder needs plain transformers only.
    script = textwrap.dedent(f"""
        import sys, json, torch
        sys.modules["peft"] = None
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.utils import is_peft_available
        try:
            import peft
            raise SystemExit("peft is importable")
        except ImportError:
            pass
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained({str(out)!r})
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        with torch.no_grad():
            torch.save(model(input_ids=ids).logits, {str(tmp_path / "logits.pt")!r})
        rendered = tokenizer.apply_chat_template({conversation!r}, tokenize=False, add_generation_prompt=True)
        print(json.dumps({{"peft": is_peft_available(), "class": type(model).__name__, "rendered": rendered,
                          "quantized": hasattr(model.config, "quantization_config"),
                          "pad": GenerationConfig.from_pretrained({str(out)!r}).pad_token_id}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["peft"] is False and report["class"] == "LlamaForCausalLM" and not report["quantized"]
    assert report["rendered"] == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert report["pad"] == tokenizer.pad_token_id
    got = torch.load(tmp_path / "logits.pt")
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    with tuned.disable_adapter():  # and the adapter really changed something
        assert not torch.allclose(logits_of(tuned, ids), expected, atol=1e-3)


def test_merge_refuses_a_bad_dtype_or_an_output_that_would_destroy_data(tiny_run, tmp_path):
    with pytest.raises(RecipeError, match=r"--dtype: must be one of bf16, fp16, fp32 \(bfloat16, float16, float32\), got .int8."):
        merge(tiny_run.run_dir, dtype="int8")
    with pytest.raises(WorkbenchError, match="--out: .* would overwrite the run itself"):
        merge(tiny_run.run_dir, out=tiny_run.run_dir)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(WorkbenchError, match="--out: .* exists and was not written by workbench merge"):
        merge(tiny_run.run_dir, out=tmp_path / "notes")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_push_to_hub_offline_or_unreachable_is_a_clear_error(tiny_run, tmp_path, monkeypatch):
    from huggingface_hub import constants

    out = tmp_path / "merged"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WorkbenchError, match=r"^--push-to-hub me/tiny: the Hugging Face Hub is offline"):
        merge(tiny_run.run_dir, out=out, push_to_hub="me/tiny")
    assert not out.exists()  # checked before spending time on the merge

    # "online" but no network: a closed local port stands in for the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    with pytest.raises(WorkbenchError, match=r"^--push-to-hub me/tiny: cannot reach the Hugging Face Hub"):
        merge(tiny_run.run_dir, out=out, push_to_hub="me/tiny")
    with pytest.raises(RecipeError, match="--push-to-hub: 'not a/repo' is not a repository id"):
        merge(tiny_run.run_dir, out=out, push_to_hub="not a/repo")


# -- evaluate -----------------------------------------------------------------------------------


def test_evaluate_uses_the_training_tokenization_and_saves_base_beside_tuned(tiny_run):
    result = evaluate(tiny_run.run_dir, base=True, max_new_tokens=8)
    tuned, base = result["tuned"], result["base"]
    # same tokens, same masks, same token weighting: the run's own final eval loss, recomputed
    assert tuned["eval_loss"] == pytest.approx(tiny_run.summary["eval_loss_final"], rel=1e-4)
    assert tuned["eval_loss"] < base["eval_loss"] - 0.5
    assert tuned["perplexity"] == pytest.approx(math.exp(tuned["eval_loss"]), rel=1e-4)
    assert result["rows"] == tuned["answered"] == 40 and tuned["target_tokens"] == base["target_tokens"] > 0
    for scores in (tuned, base):
        assert 0 <= scores["exact_match"] <= scores["contains"] <= 1
    assert {"question", "reference", "tuned", "base"} <= result["examples"][0].keys()
    saved = json.loads((tiny_run.run_dir / "run.json").read_text())
    assert saved["evaluation"] == json.loads(json.dumps(result)) and saved["summary"]["status"] == "completed"
    assert "eval_loss" in format_evaluation(result) and "base" in format_evaluation(result)

    again = evaluate(tiny_run.run_dir, max_new_tokens=4, limit=5)  # tuned only: no stale base survives
    saved = json.loads((tiny_run.run_dir / "run.json").read_text())["evaluation"]
    assert saved["base"] is None and saved["rows"] == 5 and again["tuned"]["answered"] == 5


def test_evaluate_finds_the_rows_that_eval_split_held_out(tiny_recipe):
    run = train(tiny_recipe.override("data.eval=null", "data.eval_split=0.1", "training.max_steps=4"),
                progress_bar=False)
    result = evaluate(run.run_dir, max_new_tokens=2)
    assert result["rows"] == 20 and "held out" in result["data"]
    assert result["tuned"]["eval_loss"] == pytest.approx(run.summary["eval_loss_final"], rel=1e-4)


def test_accuracy_counts_exact_and_contained_answers(tiny_run, tmp_path):
    # References that are the tuned model's own greedy answers must all match exactly.
    answers = [generate(tiny_run.run_dir, p, max_new_tokens=6) for p in PROMPTS]
    data = tmp_path / "own_answers.jsonl"
    rows = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a or "x"}]}
            for p, a in zip(PROMPTS, answers)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = evaluate(tiny_run.run_dir, data=data, max_new_tokens=6, batch_size=3, save=False)
    expected = sum(1 for a in answers if a) / len(answers)
    assert result["tuned"]["exact_match"] == result["tuned"]["contains"] == expected > 0

    # a file in another layout (completion, CSV) is recognised from its columns
    csv = tmp_path / "completion.csv"
    csv.write_text("prompt,completion\nWhat is 1 plus 1?,two\nWhat is 2 plus 2?,four\nWhat is 3 plus 3?,six\n")
    result = evaluate(tiny_run.run_dir, data=csv, max_new_tokens=4, limit=2, save=False)
    assert result["format"] == "completion" and result["rows"] == 2 and result["tuned"]["eval_loss"] > 0


def test_batched_left_padded_generation_matches_one_by_one(tiny_run):
    model, tokenizer = load_for_inference(tiny_run.run_dir, base=True, device="cpu")  # long, varied answers
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # different lengths: padding is exercised
    batched = greedy_answers(model, tokenizer, prompts, max_new_tokens=12, batch_size=4)
    single = greedy_answers(model, tokenizer, prompts, max_new_tokens=12, batch_size=1)
    assert batched == single and all(batched)


# -- chat ---------------------------------------------------------------------------------------


class Recorder(io.StringIO):
    """An output stream that remembers each write, to see that answers arrive in pieces."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_chat_loop_keeps_history_resets_and_streams(tiny_path):
    from workbench.outputs.chat import ChatSession, chat_loop

    model, tokenizer = load_for_inference(tiny_path, device="cpu")  # a plain model path works too
    session = ChatSession(model, tokenizer, max_new_tokens=12)
    out = Recorder()
    chat_loop(session, io.StringIO("Tell me a short story.\n\nWhat is 2 plus 2?\n/nope\n"), out)  # then EOF
    assert [m["role"] for m in session.history] == ["user", "assistant", "user", "assistant"]
    first = session.history[1]["content"]
    assert first and first in out.getvalue() and "unknown command /nope" in out.getvalue()
    answer_writes = out.writes[out.writes.index("you> ") + 1:]
    assert len([w for w in answer_writes[:answer_writes.index("you> ")] if w.strip()]) > 1  # streamed
    # the second turn saw the first: its prompt holds the whole conversation
    assert tokenizer.decode(session._prompt_ids(session.history[:3])).count("Tell me a short story.") == 1

    chat_loop(session, io.StringIO("/reset\n/exit\nnever read\n"), out := Recorder())
    assert session.history == [] and "(conversation reset)" in out.getvalue()
    assert "never read" not in out.getvalue()


def test_a_chat_template_that_would_not_finish_is_one_line_not_a_hung_server(tiny_path):
    """The UI's Chat tab renders a run's saved template in the server's process (and off its main thread): the
    render's budget stops it, in any thread, with a message; the session takes up the next template as before."""
    import threading

    from workbench.outputs.chat import ChatSession
    from workbench.model.inference import answer

    model, tokenizer = load_for_inference(tiny_path, device="cpu")
    own = tokenizer.chat_template
    tokenizer.chat_template = ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
                               + own)
    failures = []

    def ask():
        for call in (lambda: answer(model, tokenizer, "hi", max_new_tokens=2),
                     lambda: ChatSession(model, tokenizer, max_new_tokens=2).reply("hi", io.StringIO())):
            with pytest.raises(WorkbenchError) as err:
                call()
            failures.append(str(err.value))

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and len(failures) == 2, failures
    assert all(f.startswith("the model's chat template cannot render this conversation: it ran past")
               and "\n" not in f for f in failures), failures
    tokenizer.chat_template = own
    assert answer(model, tokenizer, "hi", max_new_tokens=2).text is not None


def test_chat_in_a_terminal_streams_the_tuned_answer(tiny_run):
    import pexpect

    prompt = "Tell me a short story."
    expected = generate(tiny_run.run_dir, prompt, max_new_tokens=16)
    env = {**os.environ, "PYTHONPATH": ROOT, "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "workbench.outputs.chat", str(tiny_run.run_dir), "--max-new-tokens", "16"],
                          cwd=ROOT, env=env, encoding="utf-8", timeout=180)
    try:
        child.expect_exact("you> ")
        assert "chatting with" in child.before
        child.sendline(prompt)
        child.expect_exact("you> ")
        shown = child.before.replace("\r\n", "\n").split("\n", 1)[1]  # after the echoed line
        assert shown.strip() == expected
        child.sendline("/reset")
        child.expect_exact("(conversation reset)")
        child.expect_exact("you> ")
        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_main_reports_a_bad_source_on_one_line(capsys):
    from workbench.outputs.chat import main

    assert main(["no/such/model/folder"]) == ModelError.exit_code
    assert capsys.readouterr().err.startswith("error: model.path: no/such/model/folder does not exist")


def test_the_cli_merges_evaluates_and_shows_scores_in_the_runs_table(tiny_run, tmp_path, capsys):
    import shutil

    from workbench.frontends.cli import main

    run_dir = tmp_path / "runs" / "copy"
    shutil.copytree(tiny_run.run_dir, run_dir)
    assert main(["merge", str(run_dir), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    assert (tmp_path / "merged" / "model.safetensors").exists()
    assert "merged model:" in capsys.readouterr().out
    assert main(["eval", str(run_dir), "--base", "--limit", "3", "--max-new-tokens", "8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == 3 and printed["base"]["eval_loss"] > printed["tuned"]["eval_loss"]
    assert main(["runs", str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out
    assert f"{printed['tuned']['eval_loss']:.4g}" in table and f"{printed['base']['eval_loss']:.4g}" in table


@pytest.mark.parametrize("damage", ["weights cut short", "config cut short"])
def test_a_damaged_adapter_is_one_line_naming_the_file_and_merge_leaves_nothing(tiny_run, tmp_path, capsys, damage):
    import shutil

    from workbench.frontends.cli import main

    run_dir = tmp_path / "runs" / "copy"
    shutil.copytree(tiny_run.run_dir, run_dir)
    name = "adapter_model.safetensors" if damage == "weights cut short" else "adapter_config.json"
    damaged = run_dir / "adapter" / name
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 3])
    before = sorted(run_dir.rglob("*"))
    with pytest.raises(WorkbenchError, match=rf"^{damaged}: damaged adapter"):
        load_for_inference(run_dir, device="cpu")
    for argv in (["merge", str(run_dir)], ["generate", str(run_dir), "--prompt", "hi"]):
        capsys.readouterr()
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {damaged}: damaged adapter"), (argv, err)
    assert sorted(run_dir.rglob("*")) == before  # no merged/ or merged.tmp/ left


@pytest.mark.parametrize("spelling", ["false", "no", "off", "0"])
def test_a_run_recipe_saying_no_to_remote_code_never_runs_the_models_code(tmp_path, spelling):
    """The run's recipe is read through the schema, where the text "false" is False: bool("false") is True."""
    from safetensors.torch import save_file

    model = tmp_path / "evil"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (model / "evil.py").write_text(f"import pathlib\npathlib.Path({str(model / 'RAN')!r}).touch()\n"
                                   "from transformers import PretrainedConfig\n\n\n"
                                   "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    run_dir = tmp_path / "runs" / "x"
    (run_dir / "adapter").mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    (run_dir / "recipe.yaml").write_text(f"name: x\nmodel:\n  path: {model}\n  trust_remote_code: '{spelling}'\n")
    (run_dir / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    save_file({"w": torch.zeros(1)}, str(run_dir / "adapter" / "adapter_model.safetensors"))
    for load in (lambda: load_for_inference(run_dir, base=True, device="cpu"),
                 lambda: load_for_inference(run_dir, device="cpu"), lambda: merge(run_dir, out=tmp_path / "merged")):
        with pytest.raises(Exception):
            load()
        assert not (model / "RAN").exists()
    (run_dir / "recipe.yaml").write_text("name: x\nmodel:\n  path: builtin:tiny\n  trust_remote_code: maybe\n")
    with pytest.raises(WorkbenchError, match="trust_remote_code"):
        load_for_inference(run_dir, base=True, device="cpu")


def test_merge_replaces_only_its_own_merge_and_stages_under_a_name_of_its_own(tiny_run, tmp_path):
    user = tmp_path / "usermodel"
    user.mkdir()
    (user / "config.json").write_text('{"model_type": "llama"}')
    (user / "model.safetensors").write_bytes(b"the user's own weights")
    (tmp_path / "usermodel.tmp").mkdir()
    (tmp_path / "usermodel.tmp" / "important.txt").write_text("mine")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(WorkbenchError, match=rf"^--out: {user} exists and was not written by workbench merge"):
        merge(tiny_run.run_dir, out=user, dtype="float32")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    out = tmp_path / "merged"
    (tmp_path / "merged.tmp").mkdir()
    (tmp_path / "merged.tmp" / "important.txt").write_text("mine too")
    first = merge(tiny_run.run_dir, out=out, dtype="float32")
    assert (first / "model.safetensors").exists()
    weights = (out / "model.safetensors").read_bytes()
    again = merge(tiny_run.run_dir, out=out, dtype="float32")  # its own earlier merge: replaced
    assert again == out and (out / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "merged.tmp" / "important.txt").read_text() == "mine too"
    assert (tmp_path / "usermodel.tmp" / "important.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "merged.tmp", "usermodel", "usermodel.tmp"]


def damage_adapter(run_dir, damage: str):
    """Damage beyond truncation; returns the file the error must name."""
    config_file = run_dir / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    if damage == "empty config":
        config = {}
    elif damage == "unknown peft_type":
        config["peft_type"] = "BOGUS"
    elif damage == "rank changed":
        config["r"] = config["r"] // 2
    config_file.write_text(json.dumps(config))
    return config_file


@pytest.mark.parametrize("damage, reason", [("empty config", "no peft_type"),
                                            ("unknown peft_type", "unknown peft_type 'BOGUS'"),
                                            ("rank changed", "r is 4 but")])
def test_a_damaged_adapter_config_is_one_line_in_every_command(tiny_run, tmp_path, capsys, damage, reason):
    import shutil

    from workbench.outputs.chat import main as chat_main
    from workbench.frontends.cli import main

    run_dir = tmp_path / "runs" / "copy"
    shutil.copytree(tiny_run.run_dir, run_dir)
    damaged = damage_adapter(run_dir, damage)
    before = sorted(run_dir.rglob("*"))
    commands = {"merge": lambda: main(["merge", str(run_dir)]),
                "generate": lambda: main(["generate", str(run_dir), "--prompt", "hi"]),
                "export": lambda: main(["export", str(run_dir), "--out", str(tmp_path / "out" / "x.gguf")]),
                "chat": lambda: chat_main([str(run_dir)])}
    for name, command in commands.items():
        capsys.readouterr()
        assert command() == 1, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {damaged}: damaged adapter"), (name, err)
        assert reason in err[0], (name, err)
    assert sorted(run_dir.rglob("*")) == before and not (tmp_path / "out").exists()


def test_an_adapter_that_does_not_fit_its_base_is_one_line_naming_the_weights(tiny_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    run_dir = tmp_path / "copy"
    shutil.copytree(tiny_run.run_dir, run_dir)
    weights = run_dir / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors = {k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in tensors.items()}  # another base's
    save_file(tensors, weights)
    with pytest.raises(WorkbenchError, match=rf"^{weights}: damaged adapter .*does not fit") as err:
        load_for_inference(run_dir, device="cpu")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_merged_model_follows_the_umask_as_the_run_directory_does(tiny_run, tmp_path, umask):
    previous = os.umask(umask)  # the test's own process: restored below
    try:
        out = merge(tiny_run.run_dir, out=tmp_path / "deep" / "merged")
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's private 0700
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: 0o666 & ~umask for p in files}
    assert (tmp_path / "deep").stat().st_mode & 0o777 == 0o777 & ~umask

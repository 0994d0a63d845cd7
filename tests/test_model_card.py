"""Model cards (workbench/rundir/model_card.py) and `workbench push` (workbench/outputs/publish.py): every saved adapter and merged
model carries a README.md whose figures are the run's own, and a push fails in a second, before any merge,
when the hub cannot be reached or the repository id is bad."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from workbench import RecipeError, WorkbenchError, train
from workbench.frontends.cli import main
from workbench.outputs.merging import merge
from workbench.outputs.publish import push
from workbench.rundir.model_card import refresh_model_cards, write_model_card
from workbench.rundir.runs import RunDir

ROOT = Path(__file__).resolve().parents[1]
SHORT = ("training.max_steps=2", "output.log_every=1")


def card_of(folder: Path) -> tuple[dict, str]:
    """(front matter, body) of folder/README.md; the front matter must be valid YAML."""
    text = (folder / "README.md").read_text()
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert match, text[:300]
    return yaml.safe_load(match.group(1)), match.group(2)


def table_value(body: str, label: str) -> float:
    """The number in the card's table row `| label | value |`."""
    match = re.search(rf"^\| {re.escape(label)} \| ([^|]+) \|$", body, re.M)
    assert match, f"no row {label!r}"
    return float(match.group(1).split()[0])


def sha256(path: str) -> str:
    return hashlib.sha256((ROOT / path).read_bytes()).hexdigest()


@pytest.fixture
def tiny_run(tiny_recipe):
    return train(tiny_recipe.override(*SHORT), progress_bar=False)


def test_an_adapter_card_names_the_base_the_data_and_the_run_s_own_figures(tiny_run):
    run_dir = Path(tiny_run.run_dir)
    meta, body = card_of(run_dir / "adapter")
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    summary = json.loads((run_dir / "run.json").read_text())["summary"]

    assert meta["library_name"] == "peft" and meta["pipeline_tag"] == "text-generation"
    assert {"lora", "peft", "sft", "lora-workbench"} <= set(meta["tags"]) and "dpo" not in meta["tags"]
    assert meta["license"] == "other" and "set `license:`" in body  # the recipe names no licence
    assert "base_model" not in meta  # builtin:tiny is no hub model; the hub refuses an unknown base_model
    assert "`builtin:tiny`" in body
    for role in ("train", "eval"):
        path = recipe["data"][role]
        assert sha256(path) == summary[f"{role}_sha256"] and f"`{summary[f'{role}_sha256']}`" in body
        assert f"| {role} | `{path}` | {summary[f'{role}_samples']} |" in body
    figures = {"tokens/s": "tokens_per_s", "peak memory (MB)": "peak_memory_mb", "wall time (s)": "wall_s",
               "MFU (fraction of peak FLOP/s)": "mfu", "steps": "steps", "final train loss": "final_loss",
               "eval loss after": "eval_loss_final"}
    for label, key in figures.items():
        assert table_value(body, label) == pytest.approx(summary[key], rel=1e-5), label
    assert summary["status"] == "completed" and "figures may be incomplete" not in body  # written again at the end
    assert "| r | 8 |" in body and "| target modules | `all-linear` |" in body
    assert (run_dir / "recipe.yaml").read_text().strip() in body
    assert "PeftModel.from_pretrained(base" in body
    [result] = meta["model-index"][0]["results"]
    assert result["metrics"][0] == {"type": "loss", "value": summary["eval_loss_final"], "name": "loss (eval)"}

    # `workbench evaluate`'s scores, once stored in run.json, reach the card and its model-index
    RunDir(run_dir).update_json(evaluation={"data": "held.jsonl", "rows": 4, "run_steps": 2,
                                            "tuned": {"eval_loss": 1.25, "contains": 0.5},
                                            "base": {"eval_loss": 2.5, "contains": 0.0}})
    meta, body = card_of(write_model_card(run_dir / "adapter", run_dir, repo_id="me/tiny").parent)
    assert "| contains | 0 | 0.5 |" in body and 'PeftModel.from_pretrained(base, "me/tiny")' in body
    scores = {m["type"]: m["value"] for r in meta["model-index"][0]["results"] for m in r["metrics"]
              if r["dataset"]["name"] == "held.jsonl"}
    assert scores == {"loss": 1.25, "contains": 0.5}


def test_a_merged_folder_s_card_is_a_transformers_card(tiny_run, tmp_path):
    out = merge(tiny_run.run_dir, out=tmp_path / "merged", dtype="fp32")
    meta, body = card_of(out)
    assert meta["library_name"] == "transformers" and "lora" in meta["tags"]
    assert "merged into its weights" in body and "Weights saved in float32." in body
    assert "AutoModelForCausalLM.from_pretrained(" in body and "PeftModel" not in body


def test_a_dpo_card_names_the_objective_and_its_rewards(tmp_path):
    from workbench import Recipe

    recipe = Recipe.load(ROOT / "recipes/tiny-dpo.yaml").override(
        f"output.dir={tmp_path}/{{name}}", "output.save_every=null", "output.eval_every=null", "training.threads=1",
        *SHORT)
    summary = train(recipe, progress_bar=False).summary
    meta, body = card_of(Path(recipe.run_dir) / "adapter")
    assert "dpo" in meta["tags"] and "sft" not in meta["tags"]
    assert "`dpo`: DPO" in body and "beta = 0.1" in body
    for figure in ("reward_margin", "reward_accuracy"):
        label = figure.replace("_", " ")
        assert table_value(body, f"{label} (train, final)") == pytest.approx(summary[f"{figure}_final"], rel=1e-5)
        assert table_value(body, f"{label} (eval, final)") == pytest.approx(summary[f"eval_{figure}_final"], rel=1e-5)
    metrics = {m["type"] for m in meta["model-index"][0]["results"][0]["metrics"]}
    assert {"reward_accuracy", "reward_margin"} <= metrics


def test_a_card_that_cannot_be_written_does_not_break_the_save(tiny_recipe, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("workbench.rundir.model_card.write_model_card", refuse)
    with pytest.warns(UserWarning, match="model card not written.*No space left on device"):
        result = train(tiny_recipe.override(*SHORT), progress_bar=False)
    adapter = Path(result.run_dir) / "adapter"
    assert result.summary["status"] == "completed"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()


# -- workbench push ---------------------------------------------------------------------------


def test_push_offline_fails_at_once_without_merging(tiny_run, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir = Path(tiny_run.run_dir)
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(WorkbenchError, match=r"^push me/tiny: the Hugging Face Hub is offline \(HF_HUB_OFFLINE=1\)"):
        push(run_dir, "me/tiny", merged=True)
    assert main(["push", str(run_dir), "me/tiny", "--merged"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: push me/tiny: the Hugging Face Hub is offline")
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no merged folder, no scratch folder

    for bad in ("not a/repo", "a/b/c", "-me/tiny"):
        with pytest.raises(RecipeError, match=rf"^push: '{re.escape(bad)}' is not a repository id"):
            push(run_dir, bad)
    assert main(["push", str(run_dir), "not a/repo"]) == 2
    assert capsys.readouterr().err.startswith("error: push: 'not a/repo' is not a repository id")


class FakeHub:
    """HfApi's three calls that push makes, recording what would be uploaded."""

    uploads: list = []

    def whoami(self):
        return {"name": "me"}

    def create_repo(self, repo, repo_type, private, exist_ok):
        self.uploads.append({"repo": repo, "private": private})
        return f"https://huggingface.co/{repo}"

    def upload_folder(self, folder_path, repo_id, repo_type, commit_message):
        folder = Path(folder_path)
        self.uploads[-1].update(files=sorted(p.name for p in folder.iterdir()), card=card_of(folder),
                                message=commit_message)


def test_push_uploads_the_adapter_or_the_merged_model_with_its_card(tiny_run, monkeypatch):
    import huggingface_hub

    FakeHub.uploads = []
    monkeypatch.setattr("workbench.outputs.hub.hub_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    run_dir = Path(tiny_run.run_dir)

    assert push(run_dir, "me/tiny", private=True) == "https://huggingface.co/me/tiny"
    adapter = FakeHub.uploads[-1]
    assert adapter["private"] is True and "adapter_model.safetensors" in adapter["files"]
    meta, body = adapter["card"]
    assert meta["library_name"] == "peft" and 'PeftModel.from_pretrained(base, "me/tiny")' in body

    push(run_dir, "me/tiny-merged", merged=True)
    merged = FakeHub.uploads[-1]
    assert merged["private"] is False and "model.safetensors" in merged["files"] and "README.md" in merged["files"]
    meta, body = merged["card"]
    assert meta["library_name"] == "transformers" and 'from_pretrained("me/tiny-merged")' in body
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".push-")]  # the scratch merge is gone


def test_hand_edits_to_the_front_matter_survive_a_rewrite(tiny_run):
    card = Path(tiny_run.run_dir) / "adapter" / "README.md"
    text = card.read_text().replace("license: other", "license: apache-2.0\nbase_model: HuggingFaceTB/SmolLM2-135M")
    card.write_text(text)
    refresh_model_cards(tiny_run.run_dir)
    meta, body = card_of(card.parent)
    assert meta["license"] == "apache-2.0" and meta["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert "Licence: not set" not in body


def test_push_checks_what_it_pushes_before_the_hub(tmp_path, capsys):
    with pytest.raises(WorkbenchError) as refused:
        push(tmp_path / "nope", "me/x")
    assert "nope" in str(refused.value) and "Hub" not in str(refused.value)


def test_odd_paths_cannot_break_the_card_or_its_snippet(tiny_recipe, tmp_path):
    import ast
    import shutil

    from workbench.base.builtin import resolve_builtin

    model = tmp_path / 'my "tiny" model'
    shutil.copytree(resolve_builtin("builtin:tiny"), model)
    data = tmp_path / "a`b <script>.jsonl"
    shutil.copy(ROOT / "recipes/data/tiny_chat.jsonl", data)
    result = train(tiny_recipe.override(*SHORT, f"model.path={model}", f"data.train={data}"), progress_bar=False)
    meta, body = card_of(Path(result.run_dir) / "adapter")
    assert "`` " + str(data) + " ``" in body  # a longer fence around a backtick
    snippet = body.split("```python\n", 1)[1].split("\n```", 1)[0]
    ast.parse(snippet)  # the model path's quotes are escaped, the snippet stays Python
    assert '"' + str(model).replace('"', '\\"') + '"' in snippet


@pytest.mark.parametrize("targets, shown", [("[embed_tokens,q_proj]", True), ("all-linear", False)])
def test_a_lora_plus_card_gives_the_embedding_rate_where_targets_can_name_an_embedding(tiny_recipe, targets, shown):
    from workbench.rundir.model_card import _method_section

    recipe = tiny_recipe.override("adapter.lora_plus_ratio=16", "adapter.lora_plus_lr_embedding=3e-6",
                                  f"adapter.target_modules={targets}").model_dump(mode="json")
    body = _method_section(recipe, {})
    assert table_value(body, "LoRA+ (B's learning rate / A's)") == 16
    if shown:
        assert table_value(body, "LoRA+ learning rate of adapted embedding layers") == 3e-6
    else:  # the presets adapt Linears only
        assert "embedding" not in body

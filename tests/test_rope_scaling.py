"""model.rope_scaling: the model is loaded with its positions stretched, data.max_seq_len may grow to original x
factor (the preflight check and the estimator's longest-sequence planner both read it), a run's adapter is scored
with the same scaling, and bad input is one line naming the field."""

import json
import shutil

import pytest
import torch

from workbench.base.errors import RecipeError
from workbench.frontends.cli import main
from workbench.model.loading import load_base_model, load_config, resolve_model_path
from workbench.spec.recipe import LONGEST_TRAINED_CONTEXT, Recipe
from workbench.training.preflight import check_context_length

FP32 = ["model.dtype=float32", "training.mixed_precision=no", "training.threads=1"]


def tiny(*overrides: str) -> Recipe:
    return Recipe.load("recipes/tiny.yaml", [*FP32, *overrides])


def test_the_model_loads_with_its_positions_stretched():
    plain, scaled = tiny(), tiny("model.rope_scaling={type: linear, factor: 2}")
    config = load_config(scaled.model)
    assert config.max_position_embeddings == 2 * load_config(plain.model).max_position_embeddings
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 2.0
    ids = torch.arange(3, 60).unsqueeze(0)
    with torch.no_grad():
        a, b = load_base_model(plain).eval()(ids).logits, load_base_model(scaled).eval()(ids).logits
    assert load_base_model(scaled).model.rotary_emb.rope_type == "linear"
    assert not torch.allclose(a, b, atol=1e-4)  # every position after the first rotates half as fast
    assert torch.allclose(a[:, 0], b[:, 0], atol=1e-5)  # position 0 does not rotate at all


def test_max_seq_len_may_grow_to_the_stretched_context_and_no_further():
    base = load_config(tiny().model).max_position_embeddings
    with pytest.raises(RecipeError, match=r"stretch its positions with model.rope_scaling"):
        check_context_length(tiny(f"data.max_seq_len={base + 1}"), load_config(tiny().model))
    stretched = tiny(f"data.max_seq_len={2 * base}", "model.rope_scaling={type: yarn, factor: 2}")
    check_context_length(stretched, load_config(stretched.model))
    too_long = tiny(f"data.max_seq_len={2 * base + 1}", "model.rope_scaling={type: yarn, factor: 2}")
    with pytest.raises(RecipeError, match=rf"longer than model.rope_scaling stretches .* \({2 * base} positions\)"):
        check_context_length(too_long, load_config(too_long.model))


def test_the_estimators_longest_sequence_reads_the_scaling():
    from workbench.estimator.memory import estimate

    plain = estimate(tiny()).strategies[0]["limits"]["max_seq_len"]
    stretched = estimate(tiny("model.rope_scaling={type: linear, factor: 4}")).strategies[0]["limits"]["max_seq_len"]
    assert stretched == 4 * plain  # the tiny model's 1024 positions, not memory, bound it


def test_a_model_that_already_scales_its_positions_is_refused(tmp_path):
    folder = tmp_path / "scaled-model"
    shutil.copytree(resolve_model_path("builtin:tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    config.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(config))
    recipe = tiny(f"model.path={folder}", "model.rope_scaling={type: linear, factor: 2}")
    with pytest.raises(RecipeError, match="model.rope_scaling: .* already scales its positions .*linear"):
        load_config(recipe.model)


@pytest.mark.parametrize("value, message", [
    ("{type: linear, factor: 1}", "model.rope_scaling.factor"),
    ("{type: ntk, factor: 2}", "model.rope_scaling.type"),
    ("{factor: 2}", "model.rope_scaling.type"),
    ("{type: yarn, factor: 2, original_max_position_embeddings: -5}", "original_max_position_embeddings"),
    ("{type: yarn, factor: 2, original_max_position_embeddings: 1000000000000000000}",
     f"model.rope_scaling.original_max_position_embeddings: Input should be less than or equal to "
     f"{LONGEST_TRAINED_CONTEXT}"),
])
def test_bad_rope_scaling_is_one_line_naming_the_field(tmp_path, capsys, value, message):
    assert main(["train", "recipes/tiny.yaml", f"model.rope_scaling={value}", f"output.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists(), err


@pytest.mark.slow
def test_a_stretched_run_is_scored_with_the_scaling_it_trained_with(tmp_path):
    from workbench import train
    from workbench.outputs.evaluation import evaluate

    result = train(tiny("model.rope_scaling={type: yarn, factor: 2}", "data.max_seq_len=1100",
                        "training.max_steps=2", "output.eval_every=null", f"output.dir={tmp_path}/run"),
                   progress_bar=False)
    assert result.summary["status"] == "completed"
    report = evaluate(result.run_dir)
    assert report["tuned"]["eval_loss"] == pytest.approx(result.summary["eval_loss_final"], rel=1e-5)

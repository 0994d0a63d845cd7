"""The run's summary is written and read through one type (workbench/rundir/run_summary.py): what a run writes into run.json
reads back by attribute, its grouped figures in their groups."""

from workbench.rundir.run_summary import HEADLINE, RunSummary
from workbench.rundir.runs import summary_html


def finished() -> RunSummary:
    s = RunSummary(status="completed", strategy="ddp", world_size=2, total_steps=4, params=1000, trainable_params=10)
    s.precision = {"model_dtype": "float32", "mixed_precision": "no"}
    s.data = {"train_examples": 12, "train_sha256": "ab" * 32}
    s.steps, s.tokens, s.wall_s, s.tokens_per_s, s.peak_memory_mb, s.mfu = 4, 800, 2.5, 320.0, 611.5, 0.0012
    s.final_loss, s.eval_loss_first, s.eval_loss_final = 2.25, 3.0, 2.5
    s.eval_final = {"eval_reward_margin_final": 0.5}
    s.preference_final = {"reward_accuracy_final": 0.75}
    s.prediction = {"predicted_peak_memory_mb": 640.0, "predicted_strategy": "ddp"}
    return s


def test_what_a_run_writes_reads_back_by_attribute():
    written = finished()
    record = {**written.at_start(), **written.at_first_step(), **written.at_end()}
    s = RunSummary.read(record)
    assert (s.status, s.strategy, s.world_size, s.steps, s.tokens) == ("completed", "ddp", 2, 4, 800)
    assert (s.peak_memory_mb, s.tokens_per_s, s.mfu, s.final_loss) == (611.5, 320.0, 0.0012, 2.25)
    assert s.predicted_peak_memory_mb == 640.0 and s.prediction["predicted_strategy"] == "ddp"
    assert s.eval_final == {"eval_reward_margin_final": 0.5}
    assert s.preference_final == {"reward_accuracy_final": 0.75}
    assert s.data["train_sha256"] == "ab" * 32 and s.data["model_dtype"] == "float32"
    assert {**s.at_start(), **s.at_first_step(), **s.at_end()} == record  # read and written again: the same


def test_a_partial_record_reads_as_missing_figures():
    s = RunSummary.read({"summary_of": "another tool"} | {"steps": 3})
    assert s.status is None and s.steps == 3 and s.peak_memory_mb is None and s.predicted_peak_memory_mb is None
    assert RunSummary.read(None).status is None


def test_every_headline_figure_is_a_summary_attribute_and_shows_in_the_notebook_table():
    s = finished()
    for name, _ in HEADLINE:
        assert hasattr(s, name), name
    record = {**s.at_start(), **s.at_first_step(), **s.at_end()}
    table = summary_html("tiny", record)
    for _, label in HEADLINE:
        assert f">{label}<" in table, label
    assert ">640<" in table.replace("640.0", "640")  # the estimator's prediction, from its group


def test_the_runs_table_shows_a_run_files_escape_sequences_escaped(tmp_path, capsys):
    import json

    from workbench import Recipe
    from workbench.frontends.cli import main

    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    Recipe.load("recipes/tiny.yaml").save(run / "recipe.yaml")
    hostile = "\x1b]0;pwned\x07\x1b[2J\rcompleted\x9b"
    (run / "run.json").write_text(json.dumps({"env": {}, "summary": {"status": hostile, "steps": 1,
                                                                      "strategy": f"single{hostile}"}}))
    assert main(["runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "pwned" in out and not any(c in out for c in "\x1b\x07\r\x9b"), out


def test_the_runs_command_and_a_run_record_keep_a_folder_name_on_its_line(tmp_path, capsys):
    """A newline in output.dir used to split a row of the runs table and the "unreadable" error, and an escape
    sequence in the folder `workbench runs` was given reached the terminal raw."""
    import json

    import pytest

    from workbench import Recipe
    from workbench.base.errors import WorkbenchError
    from workbench.frontends.cli import main
    from workbench.rundir.runs import RunDir

    run = tmp_path / "runs" / "ti\nny"
    run.mkdir(parents=True)
    Recipe.load("recipes/tiny.yaml").save(run / "recipe.yaml")
    (run / "run.json").write_text(json.dumps({"env": {}, "summary": {"status": "completed", "steps": 1}}))
    assert main(["runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "ti\\x0any" in out and not any(line.strip("│ ").startswith("ny") for line in out.splitlines()), out
    (run / "run.json").write_text("{not json")
    with pytest.raises(WorkbenchError) as unreadable:
        RunDir(run).read_json()
    assert str(unreadable.value).startswith(f"{tmp_path}/runs/ti\\x0any/run.json: unreadable (")
    assert "\n" not in str(unreadable.value)
    assert main(["runs", str(tmp_path / "\x1b[2Jnothing")]) == 0
    assert capsys.readouterr().out == f"no runs under {tmp_path}/\\x1b[2Jnothing\n"

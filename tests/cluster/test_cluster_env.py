"""What engines tell a process through its environment, read without training: Kubernetes' PET_* defaults, a
half-configured launch refused, the CPU quota of a real cgroup, the stop-signal list, the owner of a run.json,
`--resume auto` on the command line, the sbatch script."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.base.errors import RecipeError
from workbench.distributed.cluster_env import launch_defaults
from workbench.distributed.stopping import STOP_SIGNAL_ENV, parse_signal, stop_signals
from workbench.frontends.cli import _resume_auto, build_parser, main
from workbench.hardware.current import cgroup_cpu_quota
from workbench.rundir.runs import RunLock, load_run

RECIPE = "recipes/tiny.yaml"


@pytest.fixture(autouse=True)
def no_launch_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PET_NNODES", "PET_NODE_RANK",
                 "PET_NPROC_PER_NODE", "JOB_COMPLETION_INDEX", STOP_SIGNAL_ENV, "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


def stop_a_live_run(run: Path) -> int:
    """`workbench stop RUN` while a live run holds the directory's lock; its exit code."""
    lock = RunLock(run)
    lock.acquire()
    try:
        return main(["stop", str(run)])
    finally:
        lock.release()


def test_resume_auto_is_one_flag_and_a_plain_resume_never_takes_the_recipe():
    parser = build_parser()
    args = parser.parse_args(_resume_auto(["train", "--resume", "auto", RECIPE]))
    assert args.resume_auto and args.recipe == RECIPE
    args = parser.parse_args(_resume_auto(["train", "--resume", RECIPE]))
    assert args.resume is True and not args.resume_auto and args.recipe == RECIPE
    args = parser.parse_args(_resume_auto(["launch", RECIPE, "--resume=auto"]))
    assert args.resume_auto


def test_launch_takes_a_pods_pet_variables_as_its_defaults(monkeypatch, capsys):
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "1")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert main(["launch", RECIPE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "defaults from PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, MASTER_ADDR, MASTER_PORT" in out
    for flag in ("--num_processes 2", "--num_machines 2", "--machine_rank 1", "--main_process_ip 10.1.2.3",
                 "--main_process_port 23456"):
        assert flag in out
    assert main(["launch", RECIPE, "--dry-run", "--node-rank", "0"]) == 0  # a flag wins
    assert "--machine_rank 0" in capsys.readouterr().out


def test_an_indexed_jobs_completion_index_is_the_node_rank():
    found = launch_defaults({"PET_NNODES": "2:2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "job-0.svc",
                             "MASTER_PORT": "29500"})
    assert (found.nnodes, found.node_rank, found.master) == (2, 1, "job-0.svc:29500")


@pytest.mark.parametrize("env, named", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, ("WORLD_SIZE is 2", "MASTER_ADDR")),  # left over from another launch
    ({"RANK": "0"}, ("RANK", "WORLD_SIZE")),
    ({"WORLD_SIZE": "2"}, ("WORLD_SIZE", "RANK")),
    ({"MASTER_ADDR": "10.0.0.1"}, ("MASTER_ADDR", "MASTER_PORT")),
])
def test_a_half_configured_env_is_refused_naming_both_before_anything_trains(monkeypatch, capsys, tmp_path, env,
                                                                             named):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["train", RECIPE, f"output.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in named) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, named", [
    ({"PET_NNODES": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "PET_NODE_RANK"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0"}, "MASTER_ADDR"),
    ({"PET_NNODES": "1:4"}, "elastic"),
    ({"PET_NPROC_PER_NODE": "two"}, "PET_NPROC_PER_NODE"),
])
def test_a_half_configured_pod_is_refused_by_launch(monkeypatch, capsys, env, named):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["launch", RECIPE, "--dry-run"]) == 2
    assert named in capsys.readouterr().err


def test_stop_signals_are_int_term_usr1_and_one_configured(monkeypatch, capsys):
    assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    monkeypatch.setenv(STOP_SIGNAL_ENV, "usr2")
    assert stop_signals()[-1] == signal.SIGUSR2
    assert parse_signal("SIGALRM") == signal.SIGALRM and parse_signal("12") == 12
    for bad in ("KILL", "NOPE"):
        with pytest.raises(RecipeError, match="--stop-signal"):
            parse_signal(bad)
    assert main(["train", RECIPE, "--stop-signal", "STOP"]) == 2
    assert "--stop-signal: SIGSTOP cannot stop a run cleanly" in capsys.readouterr().err


def test_requeue_outside_slurm_is_refused_before_training(capsys):
    assert main(["train", RECIPE, "--requeue"]) == 2
    assert "--requeue: not inside a SLURM job" in capsys.readouterr().err


def test_a_running_record_whose_owner_is_gone_reads_as_died(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    import socket

    (run / "run.json").write_text(json.dumps({"env": {}, "summary": {
        "status": "running", "owner": {"host": socket.gethostname(), "pid": dead.pid, "started": 1.0}}}))
    lock = RunLock(run)
    lock.acquire()  # the lock alone would say "in use" (a lock on shared storage may outlive its holder's host)
    try:
        assert load_run(run).summary["status"] == "died"
        (run / "run.json").write_text(json.dumps({"env": {}, "summary": {
            "status": "running", "owner": {"host": socket.gethostname(), "pid": os.getpid(), "started": None}}}))
        assert load_run(run).summary["status"] == "running"  # this process: alive
    finally:
        lock.release()


def test_cgroup_quota_files_v1_and_v2(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.0


def test_threads_follow_the_cpu_quota_of_a_real_cgroup(tmp_path):
    """A process in a cgroup limited to one CPU takes one thread, where os.cpu_count() sees them all."""
    if os.cpu_count() < 2:
        pytest.skip("needs 2 CPUs to tell a quota of 1 from the whole machine")
    group = Path("/sys/fs/cgroup/cpu") / f"workbench-test-{os.getpid()}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    try:
        if v2.exists():
            group = Path("/sys/fs/cgroup") / f"workbench-test-{os.getpid()}"
            group.mkdir()
            (group / "cpu.max").write_text("100000 100000")
        else:
            group.mkdir()
            (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as err:
        pytest.skip(f"cannot create a cgroup with a CPU quota here ({err.strerror}): needs root and a writable "
                    "cgroup cpu controller")
    try:
        code = ("import os; open(os.environ['CG'] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                "from workbench.distributed.accelerator import configure_threads; print(configure_threads(None))")
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
        out = subprocess.run([sys.executable, "-c", code], env={**env, "CG": str(group)}, capture_output=True,
                             text=True, timeout=120)
        assert "(1, 'cgroup CPU quota 1 / 1 local process')" in out.stdout, out.stdout + out.stderr
    finally:
        group.rmdir()


def test_slurm_writes_a_requeueable_script_with_the_jobs_own_port(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    assert main(["slurm", RECIPE, f"output.dir={tmp_path}/runs/tiny", "--nodes", "2", "--gpus-per-node", "8",
                 "--time", "24:00:00", "--script", str(script)]) == 0
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --open-mode=append", "#SBATCH --requeue",
                 "#SBATCH --signal=USR1@120", "#SBATCH --time=24:00:00", "MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))",
                 "--nproc 8 --resume auto --requeue", '--node-rank "$SLURM_NODEID"'):
        assert line in text, line
    assert f"#SBATCH --output={tmp_path}/runs/tiny-%j.log" in text  # beside the run directory, appended
    assert "#SBATCH --cpus-per-task=8" in text  # one CPU per process at least: SLURM's default is one per task
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert main(["slurm", RECIPE, "--nodes", "0"]) == 2
    assert "--nodes: must be at least 1" in capsys.readouterr().err
    for cpus in ("0", "-1", "1"):
        assert main(["slurm", RECIPE, "--nproc-per-node", "2", "--cpus-per-task", cpus, "--script",
                     str(script)]) == 2
        assert "--cpus-per-task: " + cpus + " CPUs for 2 processes per machine" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--time", "1:00:00\ntouch /tmp/pwned"], "--time"),
    (["--partition", "debug\necho hi"], "--partition"),
    (["--partition", "a b"], "--partition: one word"),
    (["--sbatch-arg", "--comment=x\ntouch /tmp/pwned"], "--sbatch-arg"),
    (["--sbatch-arg", "touch /tmp/pwned"], "--sbatch-arg: an sbatch option"),
    (["name=a\nb"], "key=value"),
])
def test_a_value_that_would_add_a_line_to_the_sbatch_script_is_refused(tmp_path, capsys, flags, named):
    from workbench.frontends.cli import main

    script = tmp_path / "job.sbatch"
    assert main(["slurm", "recipes/tiny.yaml", f"output.dir={tmp_path}/runs/{{name}}", "--script", str(script),
                 *flags]) == 2
    assert f"error: {named}" in capsys.readouterr().err
    assert not script.exists()


def test_workbench_stop_never_writes_through_a_link_in_the_run_directory(tmp_path, capsys):
    import json as json_

    from workbench.frontends.cli import main

    run = tmp_path / "run"
    run.mkdir()
    from workbench.rundir.runs import process_owner

    (run / "run.json").write_text(json_.dumps({"summary": {"status": "running", "owner": process_owner()}, "env": {}}))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (run / "STOP").symlink_to(victim)
    assert stop_a_live_run(run) == 1
    assert victim.read_text() == "precious" and "cannot write the stop request" in capsys.readouterr().err


def test_slurm_refuses_to_overwrite_a_file_it_did_not_write_and_a_spaced_output_dir(tmp_path, capsys):
    from workbench.frontends.cli import main

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(open(RECIPE).read())
    assert main(["slurm", str(recipe), f"output.dir={tmp_path}/runs/tiny", "--script", str(recipe)]) == 2
    assert "is not a script `workbench slurm` wrote" in capsys.readouterr().err
    assert recipe.read_text() == open(RECIPE).read()
    script = tmp_path / "job.sbatch"
    for _ in range(2):  # its own script it replaces
        assert main(["slurm", RECIPE, f"output.dir={tmp_path}/runs/tiny", "--script", str(script)]) == 0
    assert main(["slurm", RECIPE, f"output.dir={tmp_path}/x y", "--script", str(tmp_path / "b.sbatch")]) == 2
    assert "output.dir" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["WINCH", "CONT", "TSTP"])
def test_a_signal_a_run_gets_in_normal_use_is_no_stop_signal(name):
    from workbench.base.errors import RecipeError
    from workbench.distributed.stopping import parse_signal

    with pytest.raises(RecipeError, match=f"SIG{name} cannot stop a run cleanly"):
        parse_signal(name)


def test_a_count_in_other_digits_is_refused_in_one_line(monkeypatch, capsys):
    from workbench.frontends.cli import main

    monkeypatch.setenv("PET_NNODES", "²")
    assert main(["launch", RECIPE, "--dry-run"]) == 2
    assert "PET_NNODES" in capsys.readouterr().err


def test_the_printed_launch_command_carries_the_stop_signal(capsys):
    for nproc in ("1", "2"):
        assert main(["launch", RECIPE, "--nproc", nproc, "--dry-run", "--stop-signal", "usr2"]) == 0
        assert f"{STOP_SIGNAL_ENV}=SIGUSR2 " in capsys.readouterr().out  # run as printed, it stops on USR2 too
    assert STOP_SIGNAL_ENV not in os.environ  # given to the ranks in their environment, not set in this one


def test_workbench_stop_says_so_when_the_run_ends_as_the_request_is_written(tmp_path, capsys, monkeypatch):
    from workbench.rundir.runs import RunDir, process_owner

    run = tmp_path / "run"
    run.mkdir()
    record = {"summary": {"status": "running", "owner": process_owner()}, "env": {}}
    (run / "run.json").write_text(json.dumps(record))
    written = RunDir.request_stop

    def the_run_completes_meanwhile(self):
        written(self)
        (run / "run.json").write_text(json.dumps({**record, "summary": {"status": "completed"}}))

    monkeypatch.setattr(RunDir, "request_stop", the_run_completes_meanwhile)
    assert stop_a_live_run(run) == 1
    assert "the run ended (status completed) before it could read the stop request" in capsys.readouterr().err
    assert not (run / "STOP").exists()  # no request left behind for a later run of the folder


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_launch_never_passes_on_a_stale_rank(monkeypatch, capsys, nproc):
    from workbench.distributed.launcher import plan_launch

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["launch", RECIPE, "--nproc", nproc, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("env -u RANK -u WORLD_SIZE ")  # the printed command runs as planned
    environment = plan_launch(RECIPE, nproc=int(nproc)).environment()
    assert "RANK" not in environment and "WORLD_SIZE" not in environment


def test_an_sbatch_arg_cannot_undo_what_the_script_sets(tmp_path, capsys):
    for arg in ("--cpus-per-task=1", "--output=/tmp/x.log", "--signal=TERM@1"):
        assert main(["slurm", RECIPE, f"--sbatch-arg={arg}", "--script", str(tmp_path / "job.sbatch")]) == 2
        assert "is set by the script itself" in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("arg", ["--signal USR2@10", "--sig=USR2@10", "--si=USR2@10", "--no-requeue", "--requeue",
                                 "--open=truncate", "--out /tmp/x.log", "--job=other", "--time 1", "--nodes 9",
                                 "--gpus=8", "--ntasks=4", "-o /tmp/x.log", "-J other", "-t 1",
                                 "--qos=high --signal=USR2@10", "--qos=high -o /tmp/x.log"])
def test_an_sbatch_arg_cannot_set_the_scripts_options_in_any_spelling(tmp_path, capsys, arg):
    # sbatch reads `--opt v` as `--opt=v` and any unique prefix of a long option as the option itself
    script = tmp_path / "job.sbatch"
    assert main(["slurm", RECIPE, f"--sbatch-arg={arg}", "--script", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sbatch-arg: ") and len(err.splitlines()) == 1, err
    assert not script.exists()


@pytest.mark.parametrize("arg", ['--"time"=00:01:00', '--qos=high "--time=00:01:00"', "--qos=high \\--signal=B:USR1@1",
                                 "--'signal'=USR1@1", '--qos="high"', "--comment=it's"])
def test_an_sbatch_arg_with_quotes_or_backslashes_is_refused(tmp_path, capsys, arg):
    # sbatch unquotes an #SBATCH line as it reads it: `--"time"` is --time, `\--signal` is --signal
    script = tmp_path / "job.sbatch"
    assert main(["slurm", RECIPE, f"--sbatch-arg={arg}", "--script", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sbatch-arg: ") and "holds a quote or a backslash" in err, err
    assert len(err.splitlines()) == 1, err
    assert not script.exists()


@pytest.mark.parametrize("arg, named", [("--array=0-3", "--array is not accepted"),
                                        ("--arr 1-2", "--arr (abbreviating --array) is not accepted"),
                                        ("--error=/tmp/x.err", "--error is not accepted"),
                                        ("--qos=high --err /tmp/x.err",
                                         "--err (abbreviating --error) is not accepted")])
def test_an_sbatch_arg_for_an_array_or_a_second_log_is_refused(tmp_path, capsys, arg, named):
    script = tmp_path / "job.sbatch"
    assert main(["slurm", RECIPE, f"--sbatch-arg={arg}", "--script", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --sbatch-arg: {named}: ") and len(err.splitlines()) == 1, err
    assert not script.exists()


@pytest.mark.parametrize("arg", ["--export=NONE", "--export NONE", "--expo=HF_HOME", "--qos=high --export=FOO=1",
                                 "--get-user-env", "--get-user=10L", "--export=ALL,X=1 --export=NONE",
                                 "--comment=--export=ALL --export=NONE", "--export-file=/tmp/env"])
def test_an_sbatch_arg_that_drops_the_submitting_environment_is_refused(tmp_path, capsys, arg):
    # the run was checked in the environment it is submitted from (its cache, HF_HOME, offline settings)
    script = tmp_path / "job.sbatch"
    assert main(["slurm", RECIPE, f"--sbatch-arg={arg}", "--script", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sbatch-arg: ") and len(err.splitlines()) == 1, err
    assert "environment it was submitted from" in err, err
    assert not script.exists()


def test_an_sbatch_arg_of_its_own_and_the_signal_bounds_of_slurm(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    for arg in ("--qos=high", "--nodelist node1", "--reservation=mine", "--mail-type=END",  # none the script sets
                "--export=ALL,HF_TOKEN_PATH=/secrets/t"):  # variables added to the submitting environment
        assert main(["slurm", RECIPE, f"--sbatch-arg={arg}", "--script", str(script)]) == 0, capsys.readouterr().err
        assert f"#SBATCH {arg}\n" in script.read_text()
    for seconds in ("0", "65535"):
        assert main(["slurm", RECIPE, "--signal-before", seconds, "--script", str(script)]) == 0
    capsys.readouterr()
    for seconds in ("65536", "99999999", "-1"):
        assert main(["slurm", RECIPE, "--signal-before", seconds, "--script", str(tmp_path / "b.sbatch")]) == 2
        assert "--signal-before: seconds from 0 to 65535" in capsys.readouterr().err


def test_a_script_written_elsewhere_has_its_log_folder_made(tmp_path):
    # SLURM opens #SBATCH --output before the job runs and makes no folder: a missing one ends the job, logless
    runs = tmp_path / "first" / "runs"
    script = tmp_path / "scripts" / "job.sbatch"
    assert main(["slurm", RECIPE, f"output.dir={runs}/{{name}}", "--script", str(script)]) == 0
    log = next(line for line in script.read_text().splitlines() if line.startswith("#SBATCH --output="))
    assert Path(log.removeprefix("#SBATCH --output=")).parent == runs and runs.is_dir()


def test_the_readmes_hand_written_sbatch_lines_set_master_addr_before_using_it():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.partition("Written by hand, the essential lines are:")[2].split("```bash\n", 1)[1].split("```")[0]
    assert "$MASTER_ADDR" in block  # SLURM sets no MASTER_ADDR: the lines set it, as the generated script does
    assert block.index('export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"') < \
        block.index("$MASTER_ADDR:")


@pytest.mark.parametrize("command", ["train", "launch"])
@pytest.mark.parametrize("address", ["10.0.0.1 10.0.0.2", "10.0.0.1:29500", " ", "node\x1b[2J", "-h"])
def test_a_malformed_master_addr_is_refused_in_one_line_naming_it(monkeypatch, capsys, tmp_path, command, address):
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", "29500")
    argv = [command, RECIPE, f"output.dir={tmp_path}/run", *(["--dry-run"] if command == "launch" else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    named = "error: MASTER_ADDR" if address.strip() else "error: MASTER_PORT is set ('29500') but MASTER_ADDR is not"
    assert err.startswith(named) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_master_host_is_an_address_or_a_name(monkeypatch, capsys):
    for address in ("10.0.0.1", "::1", "job-0.svc.cluster.local", "node_7"):
        launch_defaults({"MASTER_ADDR": address, "MASTER_PORT": "29500"})
    for master in ("a b:29500", "a:b:29500", "[x]:1"):
        assert main(["launch", RECIPE, "--dry-run", "--master", master]) == 2
        assert capsys.readouterr().err.startswith("error: --master: ")
    with pytest.raises(RecipeError, match="^MASTER_PORT: "):
        launch_defaults({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500x"})

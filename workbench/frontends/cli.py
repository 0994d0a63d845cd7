"""The `workbench` command: parse, call the Python API, print. No logic of its own.

Exit codes: 0 done, 1 failure, 2 bad input (recipe, flag, data), 130/143 interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from workbench.base.errors import Interrupted, RecipeError, WorkbenchError, escaped, printable

QUICKSTART = Path("recipes/quickstart.yaml")


def main(argv: list[str] | None = None) -> int:
    # A program started with SIGINT ignored (`cmd &` in a script, a UI server started that way) would
    # drop Ctrl-C and the UI's Stop: a command-line program takes the default back, before heavy imports.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while the libraries load: nothing was written yet
        return _interrupted("interrupted", 130, argv)
    except OSError as err:  # a full disk, a read-only cache, a name too long: one line, not a traceback
        if isinstance(err, BrokenPipeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        _say_error(err)
        return 1


def _main(argv: list[str] | None) -> int:
    import warnings

    from workbench.base.quiet import quiet_libraries

    # a command-line program's warnings are one line each (`workbench runs` skipping a damaged run)
    warnings.formatwarning = lambda message, category, *rest: f"warning: {printable(message)}\n"

    quiet_libraries(loads_models=False)  # the commands that load a model import it through the API, which says so
    parser = build_parser()
    args, extra = parser.parse_known_args(_resume_auto(sys.argv[1:] if argv is None else list(argv)))
    if getattr(args, "command", None) == "chat":  # the chat command parses its own arguments, --help included
        args.rest, extra = [*extra, *args.rest], []
    # argparse cannot mix positionals after options: collect key=value overrides wherever they stand
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    if getattr(args, "device_memory", None) is not None:  # the flag is the recipe setting, for this run
        args.overrides = list(args.overrides or []) + [f"distributed.device_memory={args.device_memory}"]
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
    except Interrupted as err:
        return _interrupted(f"{_rank_prefix()}{err}", err.exit_code, argv)
    except WorkbenchError as err:
        _say_error(err)
        return err.exit_code
    except KeyboardInterrupt:
        return _interrupted("interrupted", 130, argv)


def _say_error(err: BaseException) -> None:
    """The one place an error reaches the terminal: its text names recipe values and paths, which may carry
    escape sequences that would retitle or clear the terminal, so control characters are shown escaped."""
    print(f"{_rank_prefix()}error: {printable(err)}", file=sys.stderr)


def _interrupted(message: str, exit_code: int, argv: list[str] | None) -> int:
    """Say why and give the exit code of a stopped run. In the program itself (argv from the command line) another
    SIGINT from here on is ignored: Python puts the default action back while it shuts down, and a second Ctrl-C
    (or a launcher's copy of the first) landing then would end the process by the signal instead of this code."""
    if argv is None and threading.current_thread() is threading.main_thread():
        while True:  # a SIGINT landing before the ignore holds raises once more, here: ignore that one too
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                break
            except KeyboardInterrupt:
                continue
    print(printable(message), file=sys.stderr)
    return exit_code


def _resume_auto(argv: list[str]) -> list[str]:
    """`--resume auto` (or --resume=auto) as one flag: a plain `--resume` must not take the recipe after it."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--resume" and i + 1 < len(argv) and argv[i + 1] == "auto":
            out.append("--resume-auto")
            i += 2
            continue
        out.append("--resume-auto" if argv[i] == "--resume=auto" else argv[i])
        i += 1
    return out


def _rank_prefix() -> str:
    """Under a multi-process launch every rank reports its own failure, and says which rank it is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"[rank {os.environ.get('RANK', '?')}/{world}] " if world > 1 else ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="LoRA/QLoRA fine-tuning from one YAML recipe.",
                                     allow_abbrev=False)  # `--resum` is a typo, not --resume
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_parser = sub.add_parser
    sub.add_parser = lambda *a, **k: _add_parser(*a, **{"allow_abbrev": False, **k})
    _add_training_commands(sub)
    _add_recipe_commands(sub)
    _add_output_commands(sub)
    _add_interactive_commands(sub)
    return parser


def _recipe_command(sub, name: str, help_text: str, handler, optional: bool = False):
    cmd = sub.add_parser(name, help=help_text, description=help_text)
    cmd.add_argument("recipe", nargs="?" if optional else None, help="recipe YAML file")
    cmd.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. training.lr=1e-4 adapter.r=32")
    cmd.set_defaults(handler=handler)
    return cmd

def _run_flags(cmd) -> None:
    cmd.add_argument("--resume", action="store_true",
                     help="continue from the last complete checkpoint; `--resume auto`: continue where the run "
                          "directory has a checkpoint, start afresh where it has none (a requeued or restarted "
                          "job runs the same command every time)")
    cmd.add_argument("--resume-auto", action="store_true", help=argparse.SUPPRESS)
    cmd.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    cmd.add_argument("--device-memory", default=None, metavar="SIZE",
                     help="memory per device the run must fit (e.g. 24GiB; distributed.device_memory): "
                          "training.fit_check measures one step on the longest micro-batch against it before the "
                          "run starts, on a CPU too (its peak RSS)")
    cmd.add_argument("--stop-signal", default=None, metavar="SIGNAL",
                     help="one more signal that checkpoints and stops the run at the next step (SIGINT, SIGTERM "
                          "and SIGUSR1 always do), e.g. USR2")
    cmd.add_argument("--requeue", action="store_true",
                     help="SLURM: after a checkpoint taken for SIGUSR1 (the time-limit warning) or --stop-signal, "
                          "requeue this job (scontrol requeue $SLURM_JOB_ID); use with --resume auto")


def _add_training_commands(sub) -> None:
    """train, launch, ray, slurm: the ways a recipe runs."""
    train = _recipe_command(sub, "train", "train a recipe (no recipe: the quickstart)", _train, optional=True)
    _run_flags(train)
    train.add_argument("--no-progress", action="store_true", help="a plain line per logged step instead of a bar")

    launch = _recipe_command(sub, "launch", "run a recipe on N processes / M machines through accelerate launch "
                                      "(defaults from PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, "
                                      "MASTER_ADDR/MASTER_PORT where a pod sets them)", _launch)
    launch.add_argument("--nproc", type=int, default=None, help="processes on this machine (default 1)")
    launch.add_argument("--nnodes", type=int, default=None, help="machines (default 1)")
    launch.add_argument("--node-rank", type=int, default=None, help="this machine's rank (default 0)")
    launch.add_argument("--master", default=None, help="IP:PORT of the rank-0 machine (default 127.0.0.1:29500)")
    launch.add_argument("--dry-run", action="store_true", help="print the command and stop")
    _run_flags(launch)

    ray = _recipe_command(sub, "ray", "run a recipe on Ray Train workers (a local Ray, or --address); a failed worker "
                                      "group is restarted and resumes the run", _ray)
    ray.add_argument("--workers", type=int, default=2, help="Ray workers, one training process each (default 2)")
    ray.add_argument("--cpus-per-worker", type=int, default=1)
    ray.add_argument("--gpu", action="store_true", help="one GPU per worker")
    ray.add_argument("--max-failures", type=int, default=2, help="restarts of the worker group (default 2)")
    ray.add_argument("--address", default=None, help="a running Ray cluster (default: start one for this run)")
    ray.add_argument("--overwrite", action="store_true",
                     help="replace an earlier run in the run directory (otherwise its last checkpoint continues)")

    slurm = _recipe_command(sub, "slurm", "write (and with --submit, submit) an sbatch script that runs the recipe on "
                                    "SLURM, requeued and resumed by itself", _slurm)
    slurm.add_argument("--nodes", type=int, default=1, help="machines")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per machine (0: a CPU job)")
    slurm.add_argument("--nproc-per-node", type=int, default=None,
                       help="processes per machine (default: --gpus-per-node, or 1)")
    slurm.add_argument("--cpus-per-task", type=int, default=None,
                       help="CPUs for each machine's launcher and ranks (default: one per process)")
    slurm.add_argument("--time", default=None, help="time limit, e.g. 24:00:00")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--account", default=None)
    slurm.add_argument("--signal-before", type=int, default=120, metavar="SECONDS",
                       help="SIGUSR1 this long before the time limit: checkpoint and requeue (0: none)")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="FLAG",
                       help="one more #SBATCH line, e.g. --sbatch-arg=--qos=high (repeatable, unquoted)")
    slurm.add_argument("--script", default=None, help="where to write it (default: beside the run directory)")
    slurm.add_argument("--submit", action="store_true", help="also sbatch it")


def _add_recipe_commands(sub) -> None:
    """validate, show, estimate, data: questions answered before anything trains."""
    validate = _recipe_command(sub, "validate", "check a recipe and exit", _validate)
    validate.add_argument("--preflight", action="store_true",
                          help="also check data files, the output folder, free disk, the tokenizer and context length")
    _recipe_command(sub, "show", "print the resolved recipe (defaults filled in, overrides applied)", _show)

    est = _recipe_command(sub, "estimate", "memory per device for every strategy, which fits, and predicted speed", _estimate)
    est.add_argument("--nproc", "--world-size", dest="world_size", type=int, default=1,
                     help="devices in all (processes)")
    est.add_argument("--nnodes", "--nodes", dest="nnodes", type=int, default=1, help="machines the devices are spread over")
    est.add_argument("--device", default=None, help="e.g. h100-80gb, a100-40gb, rtx4090, cpu (default: this machine)")
    est.add_argument("--device-memory", default=None, help="memory of one device, e.g. 24GiB (overrides --device)")
    est.add_argument("--price-per-gpu-hour", type=float, default=None, help="for a cost estimate")
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")

    data = _recipe_command(sub, "data", "the training data as the model will see it: rows with the trained tokens marked, "
                                  "token lengths, truncation and packing", _data)
    data.add_argument("--rows", type=int, default=3, help="how many rows to show (default 3)")
    data.add_argument("--json", action="store_true", help="print JSON instead of text")
    data.add_argument("--histogram", metavar="PNG", default=None, help="also save the token-length histogram")


def _add_output_commands(sub) -> None:
    """evaluate, merge, export, push: what a finished run produced."""
    ev = sub.add_parser("evaluate", aliases=["eval"], help="score a run's tuned model (and its base) on held-out data")
    ev.add_argument("run", help="run directory")
    ev.add_argument("--data", default=None, help="a data file (default: the recipe's eval data)")
    ev.add_argument("--base", action="store_true", help="score the base model beside the tuned one")
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--limit", type=int, default=None, help="score only the first N rows")
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ev.set_defaults(handler=_evaluate)

    mg = sub.add_parser("merge", help="fold a run's adapter into its base: a plain transformers model folder")
    mg.add_argument("run", help="run directory")
    mg.add_argument("--out", default=None, help="target folder (default: RUN/merged)")
    mg.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (or bfloat16, float16, float32)")
    mg.add_argument("--push-to-hub", default=None, metavar="OWNER/NAME", help="upload the merged folder")
    mg.set_defaults(handler=_merge)

    ex = sub.add_parser("export", help="a run's tuned model (or a model folder) as one GGUF file for llama.cpp, "
                                       "Ollama and LM Studio, with an Ollama Modelfile beside it")
    ex.add_argument("source", help="run directory, model folder or builtin:NAME")
    ex.add_argument("--format", default="gguf", help="gguf (the only format so far)")
    ex.add_argument("--quant", default="f16", help="f16, f32 or q8_0")
    ex.add_argument("--out", default=None, help="the .gguf file (default: RUN/gguf/RUN_NAME-QUANT.gguf for a run, "
                                                "./gguf/NAME-QUANT.gguf for a model)")
    ex.set_defaults(handler=_export)

    ps = sub.add_parser("push", help="upload a run's adapter (with its model card), or its merged model, to the "
                                     "Hugging Face Hub")
    ps.add_argument("run", help="run directory")
    ps.add_argument("repo", metavar="OWNER/NAME", help="model repository (created when missing)")
    ps.add_argument("--merged", action="store_true", help="push the merged model instead (merging first if needed)")
    ps.add_argument("--private", action="store_true", help="create the repository private")
    ps.set_defaults(handler=_push)


def _add_interactive_commands(sub) -> None:
    """chat, ui, generate, stop, runs."""
    ch = sub.add_parser("chat", help="chat in the terminal with a run's tuned model or any model", add_help=False)
    ch.add_argument("rest", nargs=argparse.REMAINDER)
    ch.set_defaults(handler=_chat)

    ui = sub.add_parser("ui", help="the web UI: configure, estimate, launch, watch and compare runs")
    ui.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    ui.add_argument("--port", type=int, default=7860)
    ui.add_argument("--auth-file", default=None, metavar="FILE",
                    help="require a login: FILE holds USER:PASS (or set WORKBENCH_UI_AUTH=USER:PASS; never on "
                         "the command line, where `ps` shows it)")
    ui.add_argument("--allow-remote-code", action="store_true",
                    help="let recipes name code that runs on this server: model.trust_remote_code (a model "
                         "repository's code) and GRPO code rewards (training.grpo.rewards module:function)")
    ui.add_argument("--root", default=".", help="workspace: where recipes/ and runs/ are")
    ui.set_defaults(handler=_ui)

    gen = sub.add_parser("generate", help="answer a prompt with a run's tuned model or any model")
    gen.add_argument("source", help="run directory, model folder, builtin:NAME or hub id")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--base", action="store_true", help="use the run's base model, without the adapter")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.set_defaults(handler=_generate)

    stop = sub.add_parser("stop", help="ask a running run to checkpoint and end at its next step (on any engine, "
                                       "Ray's workers too, where no signal reaches the loop)")
    stop.add_argument("run", help="run directory")
    stop.set_defaults(handler=_stop)

    runs = sub.add_parser("runs", help="a table of the runs under a folder")
    runs.add_argument("root", nargs="?", default="runs")
    runs.set_defaults(handler=_runs)


def _load_recipe(args):
    from workbench.spec.recipe import Recipe

    path = args.recipe
    if path is None:
        if not QUICKSTART.exists():
            raise WorkbenchError(f"no recipe given and {QUICKSTART} is not in the current folder")
        path = QUICKSTART
    return Recipe.load(path, args.overrides)


def _train(args) -> int:
    from workbench.base.heap import return_large_blocks
    from workbench.training.entry import train

    return_large_blocks()  # this process trains: freed per-step tensors go back to the system (workbench/base/heap.py)
    _stop_flags(args)
    recipe = _load_recipe(args)
    try:
        result = train(recipe, resume=_resume_of(args), overwrite=args.overwrite,
                       progress_bar="lines" if args.no_progress else True)
    except Interrupted as err:
        from workbench.frontends.slurm import requeue_self, requeue_wanted_for

        if args.requeue and requeue_wanted_for(err.exit_code - 128) and os.environ.get("RANK", "0") == "0":
            # the checkpoint first, then the requeue
            print(f"{_rank_prefix()}{printable(err)}", file=sys.stderr, flush=True)
            print(requeue_self(), file=sys.stderr, flush=True)
            return err.exit_code
        raise
    if os.environ.get("RANK", "0") == "0":  # one summary per run, not one per process
        _print_summary(result.run_dir, result.summary)
    _leave_process_group()
    return 0


def _resume_of(args) -> bool | str:
    return "auto" if args.resume_auto else args.resume


def _stop_flags(args, here: bool = True) -> None:
    """--stop-signal and --requeue, checked before anything loads. `here`: this process trains, and its stop
    signals are read from its environment (a launcher gives the signal to its ranks in theirs instead)."""
    from workbench.distributed.stopping import STOP_SIGNAL_ENV, parse_signal

    if args.stop_signal is not None:
        name = signal.Signals(parse_signal(args.stop_signal)).name
        if here:
            os.environ[STOP_SIGNAL_ENV] = name
    if args.requeue:
        from workbench.frontends.slurm import check_requeue_possible

        check_requeue_possible()


def _leave_process_group() -> None:
    """Ranks leave together: a rank exiting while another still talks to it can hang the shutdown."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _print_summary(run_dir: Path, record: dict) -> None:
    from workbench.rundir.run_summary import RunSummary

    s = RunSummary.read(record)

    def num(value, spec: str, scale: float = 1.0) -> str:  # null (a non-finite figure) prints as n/a
        return format(value * scale, spec) if isinstance(value, (int, float)) else "n/a"

    # run.json is a file like any other: its text (a hand-edited status, a model's answers) is shown escaped
    print(printable(f"run: {escaped(run_dir)}  ({s.status}, {s.steps} steps, world size {s.world_size}, {s.strategy})"))
    print(f"  wall {num(s.wall_s, '.1f')} s | {s.tokens} tokens | {num(s.tokens_per_s, '.0f')} tokens/s | "
          f"peak memory {num(s.peak_memory_mb, '.0f')} MB ({s.peak_memory_kind}) | MFU {num(s.mfu, '.2f', 100)}% | "
          + printable(f"{s.data.get('model_dtype')}, mixed precision {s.data.get('mixed_precision')}"))
    line = f"  final train loss {num(s.final_loss, '.4f')}" if s.final_loss is not None else "  no loss logged"
    if s.eval_loss_first is not None or s.eval_loss_final is not None:
        line += f" | eval loss {num(s.eval_loss_first, '.4f')} -> {num(s.eval_loss_final, '.4f')}"
    print(line)
    budget = "no end of sequence within output.sample_max_new_tokens"
    for sample in s.samples or []:
        ended = sample.get("ended", {})
        print(f"  prompt: {printable(sample['prompt'])}")
        for when in ("before", "after"):
            mark = {True: "", False: f"  [{budget}]"}.get(ended.get(when), "")
            print(f"    {when}:{' ' * (7 - len(when))}{printable(sample[when])}{mark}")


def _launch(args) -> int:
    from workbench.distributed.launcher import plan_launch, run_launch

    from workbench.distributed.cluster_env import launch_defaults

    if args.recipe is None:
        raise WorkbenchError("launch needs a recipe file")
    _stop_flags(args, here=False)
    resume = _resume_of(args)
    train_args = (["--no-progress"] + (["--resume=auto"] if resume == "auto" else ["--resume"] if resume else [])
                  + (["--overwrite"] if args.overwrite else []) + (["--requeue"] if args.requeue else []))
    pod = launch_defaults()  # a Kubernetes pod's PET_* and MASTER_* variables; flags win
    plan = plan_launch(args.recipe, args.overrides, nproc=_given(args.nproc, pod.nproc),
                       nnodes=_given(args.nnodes, pod.nnodes), node_rank=_given(args.node_rank, pod.node_rank),
                       master=_given(args.master, pod.master), train_args=train_args, stop_signal=args.stop_signal)
    if pod.source:
        print(f"# defaults from {pod.source}", flush=True)
    print(plan.shell(), flush=True)
    if args.dry_run:
        return 0
    return run_launch(plan)


def _ray(args) -> int:
    from workbench.frontends.ray import ray_train
    from workbench.spec.recipe import Recipe

    if args.recipe is None:
        raise WorkbenchError("ray needs a recipe file")
    result = ray_train(Recipe.load(args.recipe, args.overrides), num_workers=args.workers, use_gpu=args.gpu,
                       cpus_per_worker=args.cpus_per_worker, max_failures=args.max_failures, address=args.address,
                       overwrite=args.overwrite)
    _print_summary(result.run_dir, result.summary)
    return 0


def _given(flag, default):
    return default if flag is None else flag


def _slurm(args) -> int:
    from workbench.frontends.slurm import submit, write_sbatch

    if args.recipe is None:
        raise WorkbenchError("slurm needs a recipe file")
    plan = write_sbatch(args.recipe, args.overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                        nproc_per_node=args.nproc_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
                        partition=args.partition, account=args.account, signal_before_s=args.signal_before,
                        script=args.script, extra=args.sbatch_arg)
    print(f"sbatch script: {plan.path}\nlog: {plan.log}")
    if args.submit:
        print(f"submitted SLURM job {submit(plan.path)}")
    else:
        print(f"submit with: sbatch {plan.path}")
    return 0


def _validate(args) -> int:
    recipe = _load_recipe(args)
    _check_deepspeed_file(recipe)
    if args.preflight:
        from workbench.model.loading import load_config, load_tokenizer
        from workbench.training.preflight import preflight

        for warning in preflight(recipe, load_tokenizer(recipe.model, recipe.data.chat_template), load_config(recipe.model)):
            print(f"warning: {printable(warning)}")
    print(printable(f"{args.recipe}: ok (name {recipe.name}, method {recipe.adapter.method}, "
                    f"model {recipe.model.path})"))
    return 0


def _check_deepspeed_file(recipe) -> None:
    """Loading a recipe leaves its DeepSpeed JSON to the launch; validate reads it now, with the layout rules on the
    layout the file describes, so its mistakes show before any process starts."""
    from workbench.spec.strategies import layout_of, layout_problem

    dist = recipe.distributed
    if dist.strategy != "deepspeed" or not dist.deepspeed.config_file:
        return
    problem = layout_problem(recipe, layout_of(recipe, world_size=2))
    if problem:
        raise RecipeError(problem)


def _show(args) -> int:
    print(_load_recipe(args).to_yaml(), end="")
    return 0


def _estimate(args) -> int:
    import json

    from workbench.estimator.memory import estimate

    if args.recipe is None:
        raise WorkbenchError("estimate needs a recipe file")
    if args.world_size < 1 or args.nnodes < 1 or args.world_size % args.nnodes:
        raise RecipeError(f"--nproc ({args.world_size}): must be a positive multiple of --nnodes ({args.nnodes})")
    recipe = _load_recipe(args)
    try:
        est = estimate(recipe, world_size=args.world_size, nodes=args.nnodes, device=args.device,
                       device_memory=args.device_memory, price_per_gpu_hour=args.price_per_gpu_hour)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    print(json.dumps(est.to_json(), indent=2) if args.json else est.to_text())
    return 0


def _data(args) -> int:
    import json

    from workbench.outputs.preview import preview_data

    if args.recipe is None:
        raise WorkbenchError("data needs a recipe file")
    if args.rows < 0:
        raise RecipeError(f"--rows: must be 0 or more, got {args.rows}")
    histogram = _histogram_path(args.histogram)
    preview = preview_data(_load_recipe(args), rows=args.rows)
    if args.json:
        print(json.dumps(preview.to_json(), indent=2))
    else:
        _print_preview(preview)
    if histogram is not None:
        try:
            preview.histogram().savefig(histogram)
        except OSError as err:
            raise WorkbenchError(f"--histogram {histogram}: cannot write ({err.strerror or err})") from None
        print(f"histogram: {histogram}", file=sys.stderr)
    return 0


def _histogram_path(text: str | None) -> Path | None:
    """--histogram: an image file matplotlib can write, named before any work."""
    if text is None:
        return None
    path = Path(text)
    if not text.strip() or path.is_dir() or path.suffix.lower() not in (".png", ".svg", ".pdf", ".jpg", ".jpeg"):
        raise RecipeError(f"--histogram: a .png, .svg, .pdf or .jpg file to write, got {text!r}")
    return path


def _print_preview(preview) -> None:
    """Trained tokens in bold green, the rest dimmed, on a terminal; ⟦marked⟧ in a file or a pipe."""
    if not sys.stdout.isatty():
        print(preview.to_text())
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False)
    for line in preview.summary_lines():
        console.print(Text(printable(line)))
    for where, samples in preview.rows:
        for sample in samples:
            console.rule(Text(printable(sample.title(where))), style="dim")
            console.print(Text.assemble(*[(printable(text), "bold green" if trained else "dim")
                                          for text, trained in sample.spans]))


def _evaluate(args) -> int:
    import json

    from workbench.outputs.evaluation import evaluate, format_evaluation

    result = evaluate(args.run, data=args.data, base=args.base, max_new_tokens=args.max_new_tokens,
                      limit=args.limit, batch_size=args.batch_size)
    print(json.dumps(result, indent=2) if args.json else format_evaluation(result))
    return 0


def _merge(args) -> int:
    from workbench.outputs.merging import merge

    out = merge(args.run, out=args.out, dtype=args.dtype, push_to_hub=args.push_to_hub)
    print(f"merged model: {out}" + (f" (pushed to {args.push_to_hub})" if args.push_to_hub else ""))
    return 0


def _export(args) -> int:
    from workbench.outputs.gguf_export import export

    out = export(args.source, format=args.format, quant=args.quant, out=args.out)
    print(f"exported: {out}\nOllama: ollama create NAME -f {out.with_name('Modelfile')}")
    return 0


def _push(args) -> int:
    from workbench.outputs.publish import push

    url = push(args.run, args.repo, merged=args.merged, private=args.private)
    print(f"pushed {args.run}{' (merged model)' if args.merged else ''} to {url}")
    return 0


def _chat(args) -> int:
    from workbench.outputs.chat import main as chat_main

    return chat_main(args.rest)


def _ui_auth(args) -> str | None:
    if args.auth_file:
        try:
            return Path(args.auth_file).read_text().strip()
        except OSError as err:
            raise RecipeError(f"--auth-file: cannot read {args.auth_file} ({err.strerror or err})") from None
    return os.environ.get("WORKBENCH_UI_AUTH") or None


def _ui(args) -> int:
    try:
        from ui.app import launch
    except ImportError as err:
        raise WorkbenchError(f"the UI needs its extra: pip install -e \".[ui]\" ({err})") from None
    try:
        launch(host=args.host, port=args.port, auth=_ui_auth(args), root=args.root,
               allow_remote_code=args.allow_remote_code)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    except OSError as err:
        raise WorkbenchError(f"cannot serve on {args.host}:{args.port}: {err}") from None
    return 0


def _generate(args) -> int:
    from workbench.model.inference import generate

    print(generate(args.source, args.prompt, base=args.base, max_new_tokens=args.max_new_tokens))
    return 0


def _stop(args) -> int:
    from workbench.rundir.runs import load_run

    run = load_run(args.run)
    status = run.summary.get("status")
    if status != "running":
        raise WorkbenchError(f"{escaped(run.path)}: the run is not running (status {status}); nothing to stop")
    try:
        run.dir.request_stop()
    except OSError as err:
        raise WorkbenchError(f"{escaped(run.dir.stop_request)}: cannot write the stop request ({err.strerror or err})") from None
    ended = load_run(args.run).summary.get("status")
    if ended != "running":  # it finished (or died) while the request was being written: nobody will read it
        run.dir.stop_request.unlink(missing_ok=True)
        raise WorkbenchError(f"{escaped(run.path)}: the run ended (status {ended}) before it could read the stop request; "
                             "nothing to stop")
    print(f"{escaped(run.path)}: asked to stop at its next step; it saves a checkpoint first and ends as a SIGTERM would "
          "(run the same command with --resume, or --resume auto, to continue)")
    return 0


def _runs(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from workbench.rundir.runs import COMPARE_COLUMNS, compare_rows, list_runs

    rows = compare_rows(list_runs(args.root))
    if not rows:
        print(f"no runs under {escaped(args.root)}")
        return 0
    columns = [c for c in COMPARE_COLUMNS if any(row[c] is not None for row in rows)]  # no empty columns
    table = Table(show_lines=False)
    for column in columns:
        table.add_column(column, justify="left" if column in ("run", "status", "method", "strategy") else "right",
                         overflow="fold")
    for row in rows:
        table.add_row(*(Text(_cell(row[c])) for c in columns))  # Text: a run's name is no markup
    Console(width=240).print(table)
    return 0


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return escaped(value)  # names and statuses read from each run's files: a newline would split the row

"""The `workbench` command: parse, call the Python API, print. No logic of its own.

Exit codes: 0 done, 1 failure, 2 bad input (recipe, flag, data), 130/143 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import WorkbenchError

QUICKSTART = Path("recipes/quickstart.yaml")


def main(argv: list[str] | None = None) -> int:
    from .quiet import quiet_libraries

    quiet_libraries()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse cannot mix positionals after options: collect key=value overrides wherever they stand
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
    except WorkbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="LoRA/QLoRA fine-tuning from one YAML recipe.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def recipe_command(name: str, help_text: str, handler, optional: bool = False):
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("recipe", nargs="?" if optional else None, help="recipe YAML file")
        cmd.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. training.lr=1e-4 adapter.r=32")
        cmd.set_defaults(handler=handler)
        return cmd

    train = recipe_command("train", "train a recipe (no recipe: the quickstart)", _train, optional=True)
    train.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    train.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    recipe_command("validate", "check a recipe and exit", _validate)
    recipe_command("show", "print the resolved recipe (defaults filled in, overrides applied)", _show)

    gen = sub.add_parser("generate", help="answer a prompt with a run's tuned model or any model")
    gen.add_argument("source", help="run directory, model folder, builtin:NAME or hub id")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--base", action="store_true", help="use the run's base model, without the adapter")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.set_defaults(handler=_generate)

    runs = sub.add_parser("runs", help="a table of the runs under a folder")
    runs.add_argument("root", nargs="?", default="runs")
    runs.set_defaults(handler=_runs)
    return parser


def _load_recipe(args):
    from .recipe import Recipe

    path = args.recipe
    if path is None:
        if not QUICKSTART.exists():
            raise WorkbenchError(f"no recipe given and {QUICKSTART} is not in the current folder")
        path = QUICKSTART
    return Recipe.load(path, args.overrides)


def _train(args) -> int:
    from .train import train

    recipe = _load_recipe(args)
    result = train(recipe, resume=args.resume, overwrite=args.overwrite, progress_bar=not args.no_progress)
    _print_summary(result.run_dir, result.summary)
    return 0


def _print_summary(run_dir: Path, s: dict) -> None:
    print(f"run: {run_dir}  ({s['status']}, {s['steps']} steps, world size {s['world_size']}, {s['strategy']})")
    print(f"  wall {s['wall_s']:.1f} s | {s['tokens']} tokens | {s['tokens_per_s']:.0f} tokens/s | "
          f"peak memory {s['peak_memory_mb']:.0f} MB ({s['peak_memory_kind']}) | MFU {100 * s['mfu']:.2f}%")
    line = f"  final train loss {s['final_loss']:.4f}" if s.get("final_loss") is not None else "  no loss logged"
    if s.get("eval_loss_first") is not None:
        line += f" | eval loss {s['eval_loss_first']:.4f} -> {s['eval_loss_final']:.4f}"
    print(line)
    for sample in s.get("samples", []):
        print(f"  prompt: {sample['prompt']}\n    before: {sample['before']}\n    after:  {sample['after']}")


def _validate(args) -> int:
    recipe = _load_recipe(args)
    print(f"{args.recipe}: ok (name {recipe.name}, method {recipe.adapter.method}, model {recipe.model.path})")
    return 0


def _show(args) -> int:
    print(_load_recipe(args).to_yaml(), end="")
    return 0


def _generate(args) -> int:
    from .export import generate

    print(generate(args.source, args.prompt, base=args.base, max_new_tokens=args.max_new_tokens))
    return 0


def _runs(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .runs import COMPARE_COLUMNS, compare_rows, list_runs

    rows = compare_rows(list_runs(args.root))
    if not rows:
        print(f"no runs under {args.root}")
        return 0
    table = Table(show_lines=False)
    for column in COMPARE_COLUMNS:
        table.add_column(column, justify="left" if column in ("run", "status", "method", "strategy") else "right")
    for row in rows:
        table.add_row(*(_cell(row[c]) for c in COMPARE_COLUMNS))
    Console(width=240).print(table)
    return 0


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

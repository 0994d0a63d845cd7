"""The workspace root: every file the UI reads or writes is resolved here and refused if it lies outside.

Paths come from form fields, dropdowns and recipes, so each one is treated as untrusted:
it is joined to the root, fully resolved (symlinks followed) and must still be inside the root.
"""

from __future__ import annotations

import os
from pathlib import Path

from workbench.base.errors import WorkbenchError
from workbench.spec.rewards import is_code

RECIPE_SUFFIXES = (".yaml", ".yml")
RUN_ENTRIES = ("run.json", "recipe.yaml", "metrics.jsonl", "adapter", "model", "checkpoints")
UI_DIR = ".workbench-ui"  # the UI's own files (job registry, logs, CSV exports) live here, under the root


class PathError(WorkbenchError):
    """A path that leaves the workspace root, or is not the kind of file asked for."""

    exit_code = 2


class Workspace:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise PathError(f"workspace root {self.root} is not a folder")

    def resolve(self, relative: str | Path, *, what: str = "path") -> Path:
        """`relative` joined to the root and resolved; PathError if it ends up outside the root."""
        text = str(relative).strip()
        if not text or "\x00" in text:
            raise PathError(f"{what}: empty or invalid path")
        path = (self.root / Path(text).expanduser()).resolve()
        if not path.is_relative_to(self.root):
            raise PathError(f"{what}: {text} is outside the workspace {self.root}; refused")
        return path

    def relative(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()

    def recipe_file(self, relative: str, *, must_exist: bool = True, what: str = "recipe file") -> Path:
        path = self.resolve(relative, what=what)
        if path.suffix not in RECIPE_SUFFIXES:
            raise PathError(f"{what}: {relative} must end in .yaml or .yml")
        if must_exist and not path.is_file():
            raise PathError(f"{what}: {relative} does not exist")
        return path

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def ui_dir(self) -> Path:
        return self.root / UI_DIR

    def ui_folder(self, *parts: str) -> Path:
        """A folder of the UI's own files, <root>/.workbench-ui/<parts>, created; PathError when it or a folder on
        the way is a symbolic link or no folder (a workspace can ship one leading elsewhere): never followed."""
        path = self.root
        for part in (UI_DIR, *parts):
            path = path / part
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                where = path.relative_to(self.root).as_posix()
                raise PathError(f"{where} is a symbolic link or not a folder: the UI keeps its own files there and "
                                "does not follow it; refused (remove it and try again)")
            try:
                path.mkdir(exist_ok=True)
            except OSError as err:
                raise PathError(f"{path.relative_to(self.root).as_posix()}: cannot create ({err.strerror or err})") \
                    from None
        if not path.resolve().is_relative_to(self.root):
            raise PathError(f"{path.relative_to(self.root).as_posix()} is outside the workspace {self.root}; refused")
        return path

    def recipe_choices(self) -> list[str]:
        """Recipes a user can load: recipes/*.yaml and the resolved recipe of every run."""
        found = []
        for pattern in ("recipes/*.yaml", "recipes/*.yml", "runs/*/recipe.yaml"):
            found += [self.relative(p) for p in sorted(self.root.glob(pattern)) if self._inside(p)]
        return found

    def run_choices(self, with_adapter: bool = False) -> list[str]:
        """Run directory names under runs/ (those with a run.json; optionally only finished ones)."""
        if not self.runs_dir.is_dir():
            return []
        names = []
        for child in sorted(self.runs_dir.iterdir()):
            if not (child / "run.json").is_file() or not self._inside(child):
                continue
            if with_adapter and not ((child / "adapter").is_dir() or (child / "model").is_dir()):
                continue
            names.append(child.name)
        return names

    def run_dir(self, name: str) -> Path:
        path = self.resolve(f"runs/{name}", what="run")
        if path != self.runs_dir / path.name or self.runs_dir.is_symlink() or not (path / "run.json").is_file():
            raise PathError(f"run: {name} is not a run under {self.runs_dir}")
        for entry in RUN_ENTRIES:  # what Compare and Chat read inside it must not lead out either
            if (path / entry).is_symlink() or ((path / entry).exists() and not self._inside(path / entry)):
                raise PathError(f"run: {name}/{entry} is a symbolic link; refused")
        return path

    def check_recipe_paths(self, recipe, allow_remote_code: bool = False) -> Path:
        """The files a run will read and write must stay inside the workspace too, and its run directory is
        a folder directly under runs/ (so replacing it can never delete recipes, other runs or the UI's own
        files). Returns that run directory."""
        out = str(recipe.run_dir)
        run_dir = self.resolve(out, what="output.dir")
        # compared unresolved too: a runs/ that is a symbolic link (to the root, say) must not pass
        if run_dir != self.runs_dir / run_dir.name or self.runs_dir.is_symlink() or run_dir.is_symlink():
            raise PathError(f"output.dir: {out} must be a folder directly under runs/ (e.g. runs/{{name}}); refused")
        if recipe.model.trust_remote_code and not allow_remote_code:
            raise PathError("model.trust_remote_code: would run code from the model's repository on this server; "
                            "refused (start the UI with --allow-remote-code to permit it)")
        code_rewards = [entry.name for entry in recipe.training.grpo.rewards if is_code(entry.name)]
        if (code_rewards or recipe.training.grpo.allow_code_rewards) and not allow_remote_code:
            named = f" ({code_rewards[0]})" if code_rewards else ""
            raise PathError(f"training.grpo.rewards: a code reward{named} would import and run Python on this server; "
                            "refused (start the UI with --allow-remote-code to permit code a recipe names)")
        for k, source in enumerate(recipe.data.sources):
            self.resolve(source.path, what="data.train" if isinstance(recipe.data.train, str) else f"data.train[{k}].path")
        if recipe.data.eval:
            self.resolve(recipe.data.eval, what="data.eval")
        if recipe.distributed.deepspeed.config_file:
            self.resolve(recipe.distributed.deepspeed.config_file, what="distributed.deepspeed.config_file")
        if _is_file_name(recipe.data.chat_template):  # a Jinja file (registered names are not files)
            self.resolve(recipe.data.chat_template, what="data.chat_template")
        model = recipe.model.path
        if model.startswith((".", "/", "~")) or (self.root / model).exists():
            self.resolve(model, what="model.path")  # a local folder (builtin: names and hub ids are not files)
        here = Path(model).expanduser()
        if here.exists() and not self._inside(here):
            # Estimate and Chat load the model in this process, where a relative name is looked up from the
            # folder the server was started in
            raise PathError(f"model.path: {model} is the folder {here.resolve()}, outside the workspace {self.root}; "
                            "refused")
        return run_dir

    LOCAL_FIELDS = ("model.path", "data.train", "data.eval", "data.chat_template", "distributed.deepspeed.config_file")

    def local_recipe(self, recipe):
        """A checked recipe with its relative files made absolute paths inside the workspace: what the server
        loads itself (Estimate, Chat) would otherwise be looked up from the folder the server was started in, not
        the one the checks looked at. A relative name that is no file here but one there is refused."""
        changes = {}
        for key in self.LOCAL_FIELDS:
            section, *rest = key.split(".")
            value = getattr(recipe, section)
            for part in rest:
                value = getattr(value, part)
            if isinstance(value, list):  # data.train's sources
                sources = [source.model_copy(update={"path": self._local(source.path, f"{key}[{k}].path")})
                           for k, source in enumerate(value)]
                changes[key.replace(".", "__")] = [source.model_dump() for source in sources]
                continue
            if not value or (key == "data.chat_template" and not _is_file_name(value)):
                continue
            local = self._local(value, key)
            if local != value:
                changes[key.replace(".", "__")] = local
        return recipe.override(**changes) if changes else recipe

    def _local(self, value: str, key: str) -> str:
        """A recipe's file name as the absolute path inside the workspace, or as it is (builtin models, hub ids)."""
        if value.startswith("builtin:"):
            return value
        inside = self.resolve(value, what=key)
        if inside.exists() or value.startswith((".", "/", "~")):
            return str(inside)
        if Path(value).expanduser().exists():  # a hub id has no file of that name anywhere
            raise PathError(f"{key}: {value} is not in the workspace, but {Path(value).resolve()} outside the "
                            f"workspace {self.root} has that name; refused")
        return value

    def saved_recipe_file(self, relative: str) -> Path:
        """Where Save may write: a .yaml under recipes/ (never a run's own recipe or the UI's records)."""
        what = "Save as"  # the field the path was typed in
        path = self.recipe_file(relative, must_exist=False, what=what)
        recipes = self.root / "recipes"
        unresolved = Path(os.path.normpath(self.root / str(relative).strip()))
        if recipes.is_symlink() or unresolved.is_symlink() or path != unresolved:
            raise PathError(f"{what}: {relative} goes through a symbolic link (to {self.relative(path)}); refused")
        inside_runs = path.relative_to(self.runs_dir).parts if path.is_relative_to(self.runs_dir) else ()
        if len(inside_runs) > 1:
            raise PathError(f"{what}: {relative} is inside the run directory runs/{inside_runs[0]}, which keeps its "
                            "own recipe; save under recipes/")
        if not path.is_relative_to(recipes):
            raise PathError(f"{what}: {relative} is not under recipes/ (it is {self.relative(path)}); "
                            "save under recipes/")
        return path

    def _inside(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.root)


def _is_file_name(chat_template: str | None) -> bool:
    from workbench.spec.chat_templates import TEMPLATES

    return bool(chat_template) and chat_template not in TEMPLATES

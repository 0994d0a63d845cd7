"""The rewards GRPO scores sampled answers with (`training.grpo.rewards`): one registry of built-in verifiers,
selected by name, that the recipe checks names against, the loop calls and the docs list.

A reward is called as TRL calls its reward functions, so one written for TRL runs here unchanged:
`f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]`, one value per
completion; `prompts` are the prompts' texts (a conversation's last user turn), `completions` the decoded answers
(text, special tokens left out), `columns` every other column of the rows, each a list aligned with the
completions (e.g. `answer`). None means no reward for that completion (it is left out of its group's statistics).

A reward that is not built in is code: `module:function`, imported from the Python path. It runs only where the
recipe says so (`training.grpo.allow_code_rewards: true`): a recipe from elsewhere must not run code by naming it.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from workbench.base.errors import RecipeError, WorkbenchError

FIELD = "training.grpo.rewards"
CODE_OPT_IN = "training.grpo.allow_code_rewards"


# -- the built-ins -----------------------------------------------------------------------------------------------

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_answer(text: str) -> str | None:
    """The answer a completion gives: the content of its last \\boxed{...}, else its last number (commas between
    digits dropped), else None."""
    boxed = BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


MAX_REWARD = 1e6  # far beyond any reward's scale, far below what float32 sums of a group overflow at


def same_answer(given: str, expected: Any) -> bool:
    """Equal as numbers where both read as numbers (2, 2.0 and 2.00 agree), else as stripped text."""
    expected = str(expected).strip().replace(",", "")
    try:
        return math.isclose(float(given), float(expected), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return given.strip() == expected


def exact_answer(completions, answer=None, **_) -> list[float]:
    """1 where the completion's final answer (its last \\boxed{} or, without one, its last number) equals the row's
    `answer` column, else 0; None (unscored) where the row gives no answer."""
    if answer is None:
        raise WorkbenchError("the rows have no 'answer' column to compare with")
    return [None if expected is None else float(found is not None and same_answer(found, expected))
            for found, expected in zip(map(final_answer, completions), answer)]


def format_match(completions, pattern: str, **_) -> list[float]:
    """1 where the pattern (a Python regular expression, searched anywhere; anchor it with ^ and $ to match the
    whole answer, `.` matching newlines too) is found in the completion, else 0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.search(text) is not None) for text in completions]


def length_penalty(completions, completion_ids, target_length: int, **_) -> list[float]:
    """0 up to target_length tokens; beyond it, minus the share of target_length the completion runs over, down
    to -1 (twice the target or more)."""
    return [-min(1.0, max(0, len(ids) - target_length) / target_length) for ids in completion_ids]


def json_answer(completions, keys: list[str] | None = None, **_) -> list[float]:
    """1 where the completion (stripped, a ```json fence around it allowed) parses as JSON, and, with keys, is an
    object holding every one of them; else 0."""
    scores = []
    for text in completions:
        body = text.strip()
        fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
        try:
            value = json.loads(fenced.group(1) if fenced else body)
        except ValueError:
            scores.append(0.0)
            continue
        scores.append(float(not keys or (isinstance(value, dict) and all(k in value for k in keys))))
    return scores


@dataclass(frozen=True)
class BuiltIn:
    name: str
    summary: str
    function: Callable
    settings: tuple[str, ...] = ()  # the reward's own fields of its entry in training.grpo.rewards
    required: tuple[str, ...] = ()  # of those, the ones it cannot do without


BUILTINS: dict[str, BuiltIn] = {b.name: b for b in (
    BuiltIn("exact_answer", "1 where the answer (last \\boxed{} or last number) equals the row's `answer` column",
            exact_answer),
    BuiltIn("format", "1 where the regular expression `pattern` is found in the answer", format_match,
            settings=("pattern",), required=("pattern",)),
    BuiltIn("length", "0 up to `target_length` tokens, then down to -1 at twice that", length_penalty,
            settings=("target_length",), required=("target_length",)),
    BuiltIn("json", "1 where the answer parses as JSON (an object with every one of `keys`, where given)",
            json_answer, settings=("keys",)),
)}
SETTINGS = ("pattern", "target_length", "keys")  # every built-in's settings: the fields of a rewards entry


def is_code(name: str) -> bool:
    """`module:function` names code; a built-in's name has no colon."""
    return ":" in name


def entry_problem(name: str, settings: dict, allow_code: bool) -> str | None:
    """Why a rewards entry cannot be used (without its field's prefix), or None. Checks names and settings only:
    code is imported when the run starts (`resolve`)."""
    if is_code(name):
        module, _, function = name.partition(":")
        if not module or not function.isidentifier():
            return f"{name!r} is not module:function (e.g. my_rewards:is_correct)"
        if not allow_code:
            return (f"{name} is Python code from outside the workbench; it runs only when the recipe sets "
                    f"{CODE_OPT_IN}: true")
        extra = [k for k, v in settings.items() if v is not None]
        return f"{', '.join(extra)}: settings of the built-in rewards; {name} takes none" if extra else None
    builtin = BUILTINS.get(name)
    if builtin is None:
        return f"unknown reward {name!r} (built in: {', '.join(BUILTINS)}; or module:function with {CODE_OPT_IN})"
    missing = [k for k in builtin.required if settings.get(k) is None]
    if missing:
        return f"{name} needs {' and '.join(missing)}"
    extra = [k for k, v in settings.items() if v is not None and k not in builtin.settings]
    if extra:
        return f"{', '.join(extra)}: not a setting of {name} ({', '.join(builtin.settings) or 'it takes none'})"
    if settings.get("pattern") is not None:
        try:
            re.compile(settings["pattern"])
        except re.error as err:
            return f"pattern: not a regular expression ({err})"
    return None


# -- the run's rewards -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reward:
    """One entry of training.grpo.rewards, ready to call."""
    index: int
    name: str  # how metrics name it: rewards/<name>/mean
    function: Callable
    settings: dict

    @property
    def field(self) -> str:
        return f"{FIELD}[{self.index}] ({self.name})"

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list]) -> list[float]:
        """The reward of each completion (NaN for None), or one error naming the reward."""
        try:
            values = self.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                   **columns, **self.settings)
        except WorkbenchError as err:
            raise WorkbenchError(f"{self.field}: {err}") from None
        except (Exception, SystemExit) as err:  # the user's code: one line naming it, not their traceback (an exit
            # it calls is its failure, not the run's end)
            raise WorkbenchError(f"{self.field} failed: {type(err).__name__}: {err}") from err
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            count = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise WorkbenchError(f"{self.field}: returned {count} for {len(completions)} completions (one number "
                                 "or None per completion)")
        scores = []
        for k, value in enumerate(values):
            if value is None:
                scores.append(math.nan)
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                score = float(value)
            elif hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a 0-d tensor or numpy number
                score = float(value.item())
            else:
                raise WorkbenchError(f"{self.field}: returned {type(value).__name__} {str(value)[:40]!r} for "
                                     f"completion {k}; a reward is a number or None")
            # an infinite (or float32-overflowing) reward makes every advantage of its group NaN, then 0: the
            # whole step would learn nothing, silently
            if not math.isfinite(score) or abs(score) > MAX_REWARD:
                raise WorkbenchError(f"{self.field}: returned {score:g} for completion {k}; a reward is a finite "
                                     f"number within +-{MAX_REWARD:g} or None")
            scores.append(score)
        return scores


def resolve(entries, allow_code: bool) -> list[Reward]:
    """The recipe's rewards entries as callables; a code reward that does not import is one error naming it."""
    rewards = []
    for k, entry in enumerate(entries):
        settings = {name: getattr(entry, name) for name in SETTINGS if getattr(entry, name) is not None}
        problem = entry_problem(entry.name, settings, allow_code)
        if problem:
            raise RecipeError(f"{FIELD}[{k}]: {problem}")
        if is_code(entry.name):
            function, name = _imported(entry.name, k), entry.name.partition(":")[2]
        else:
            function, name = BUILTINS[entry.name].function, entry.name
        rewards.append(Reward(k, name, function, settings))
    names = [r.name for r in rewards]
    return [r if names.count(r.name) == 1 else Reward(r.index, f"{r.name}_{r.index}", r.function, r.settings)
            for r in rewards]


def _imported(path: str, index: int) -> Callable:
    module_name, _, attribute = path.partition(":")
    where = f"{FIELD}[{index}] ({path})"
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ModuleNotFoundError, or the module's own error while importing
        raise RecipeError(f"{where}: cannot import {module_name}: {type(err).__name__}: {err}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RecipeError(f"{where}: {module_name} has no function {attribute}")
    return function

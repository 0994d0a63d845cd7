"""The recipe form, generated from the pydantic schema, and the conversions form ↔ dict ↔ YAML.

Every leaf field of `Recipe` becomes one `FieldSpec` (a dotted path, a widget kind, choices, default,
help text). Literal → dropdown, bool → checkbox, int/float → number, str → text, list → comma text
(or a YAML flow list), optional sections get an "enabled" toggle. Validation is the CLI's own:
`Recipe.from_dict`, whose `RecipeError` message is shown as is.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from workbench.base.errors import RecipeError
from workbench.spec.objectives import OBJECTIVES
from workbench.spec.recipe import Recipe, parse_recipe_yaml

SKIP = object()  # a form value that cannot show what the YAML holds: leave the widget as it is
ENABLED = "enabled"  # the pseudo-field of an optional section

# Units and nicer words shown beside field names (presentation only).
UNITS = {
    "adapter.r": "rank", "adapter.dropout": "probability", "data.eval_split": "fraction",
    "data.max_seq_len": "tokens", "data.limit": "rows", "training.epochs": "passes",
    "training.max_steps": "optimizer steps", "training.micro_batch_size": "sequences / device",
    "training.grad_accum": "micro-batches", "training.lr": "learning rate", "training.warmup_ratio": "fraction of steps",
    "training.max_grad_norm": "L2 norm", "training.threads": "CPU threads", "output.save_every": "steps",
    "output.keep_last": "checkpoints", "output.eval_every": "steps", "output.log_every": "steps",
    "output.sample_max_new_tokens": "tokens",
    # each objective's own settings (workbench/spec/objectives.py), marked as read by it alone
    **{f"training.{field}": f"{objective.name} only" for objective in OBJECTIVES.values()
       for field, _ in objective.settings},
}


@dataclass
class FieldSpec:
    path: tuple[str, ...]
    kind: Literal["dropdown", "multiselect", "checkbox", "int", "float", "text", "list", "str_or_list", "toggle"]
    default: Any = None
    description: str = ""
    optional: bool = False
    choices: list[Any] = field(default_factory=list)

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def section(self) -> tuple[str, ...]:
        return self.path[:-1]

    @property
    def label(self) -> str:
        unit = UNITS.get(self.key)
        name = "set this section" if self.kind == "toggle" else self.path[-1]
        return f"{name} ({unit})" if unit else name


def _strip_optional(annotation) -> tuple[Any, bool]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return annotation, False


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _leaf(path: tuple[str, ...], annotation, info, default) -> FieldSpec:
    annotation, optional = _strip_optional(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    spec = FieldSpec(path, "text", default, info.description or "", optional)
    if origin is Literal:
        spec.kind, spec.choices = "dropdown", list(args)
    elif annotation is bool:
        spec.kind = "checkbox"
    elif annotation is int:
        spec.kind = "int"
    elif annotation is float:
        spec.kind = "float"
    elif origin is list and typing.get_origin(args[0]) is Literal:
        spec.kind, spec.choices = "multiselect", list(typing.get_args(args[0]))
    elif origin is list:
        spec.kind = "list"
    elif origin in (typing.Union, types.UnionType) and any(typing.get_origin(a) is Literal for a in args):
        spec.kind = "text"  # a number or a word (micro_batch_size: 4 or auto): the schema reads the text
    elif origin in (typing.Union, types.UnionType):
        spec.kind = "str_or_list"
    return spec


def schema_fields(model: type[BaseModel] = Recipe, prefix: tuple[str, ...] = ()) -> list[FieldSpec]:
    """Every leaf field of the schema, in schema order, with its default from a default instance."""
    defaults = model.model_construct().model_dump(mode="json") if prefix else Recipe.model_construct().to_dict()
    specs = []
    for name, info in model.model_fields.items():
        annotation, optional = _strip_optional(info.annotation)
        if _is_section(annotation):
            if optional:
                specs.append(FieldSpec((*prefix, name, ENABLED), "toggle", False,
                                       info.description or "", choices=[]))
            specs += schema_fields(annotation, (*prefix, name))
        else:
            specs.append(_leaf((*prefix, name), info.annotation, info, defaults.get(name)))
    return specs


FIELDS = schema_fields()


# -- dict → widget values -------------------------------------------------------------------------


def _list_text(items: list) -> str:
    if any(isinstance(i, dict) for i in items):  # data.train's sources: a YAML flow list, as the recipe writes it
        return yaml.safe_dump(items, default_flow_style=True, sort_keys=False, width=float("inf")).strip()
    texts = [str(i) for i in items]
    if any("," in t or t != t.strip() for t in texts):
        return json.dumps(texts)  # a YAML flow list keeps commas inside items
    return ", ".join(texts)


def to_widget(spec: FieldSpec, value: Any) -> Any:
    """The widget value for a recipe value, or SKIP when the widget cannot hold it."""
    if spec.kind == "toggle":
        return bool(value)
    if spec.kind == "dropdown":
        if value is None and spec.optional:
            return None
        return str(value) if value in spec.choices else SKIP
    if spec.kind == "multiselect":
        return list(value or []) if isinstance(value, (list, type(None))) else SKIP
    if spec.kind == "checkbox":
        return value if isinstance(value, bool) else SKIP
    if spec.kind in ("int", "float"):
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return SKIP
        if spec.optional:  # a text box: a number widget cannot be empty (it would send 0)
            return "" if value is None else _number_text(value)
        return value
    if spec.kind in ("list", "str_or_list"):
        if value is None:
            return ""
        return _list_text(value) if isinstance(value, list) else str(value)
    return "" if value is None else str(value)


def _get(data: dict, path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def widgets_from_dict(data: dict, fallback: dict | None = None) -> list[Any]:
    """Widget values, field by field; fields missing from `data` take their value from `fallback`."""
    values = []
    for spec in FIELDS:
        if spec.kind == "toggle":
            found, section = _get(data, spec.section)
            values.append(found and section is not None)
            continue
        found, value = _get(data, spec.path)
        if not found and fallback is not None:
            found, value = _get(fallback, spec.path)
        values.append(to_widget(spec, value) if found else SKIP)
    return values


# -- widget values → dict -------------------------------------------------------------------------


def _parse_list(text: str) -> list | None:
    text = (text or "").strip()
    if not text:
        return None
    if text.startswith("["):
        try:
            parsed = yaml.safe_load(text)
        except Exception:  # noqa: BLE001 - PyYAML raises bare ValueError etc. for bad tags: read it as text
            parsed = None
        if isinstance(parsed, list):
            return parsed
    return [item.strip() for item in text.split(",") if item.strip()]


def _number_text(value: float) -> str:
    return str(value) if isinstance(value, int) or abs(value) >= 1e-3 or value == 0 else f"{value:g}"


def _parse_number(text: str):
    """A number typed in a text box; the text itself when it is not one (the validator names the field)."""
    text = text.strip()
    if not text:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def from_widget(spec: FieldSpec, value: Any) -> Any:
    if spec.kind == "dropdown":
        if value in (None, ""):
            return None
        by_text = {str(c): c for c in spec.choices}
        return by_text.get(str(value), value)
    if spec.kind == "multiselect":
        return list(value or [])
    if spec.kind == "checkbox":
        return bool(value)
    if spec.kind in ("int", "float"):
        if isinstance(value, str):
            value = _parse_number(value)
        if value is None or value == "":
            return None
        if spec.kind == "int" and isinstance(value, float) and value.is_integer():
            return int(value)
        return value
    if spec.kind == "list":
        items = _parse_list(value)
        return items if items is not None or spec.optional else []
    if spec.kind == "str_or_list":
        if spec.key == "data.train" and not str(value or "").strip().startswith("["):
            return str(value or "").strip() or None  # one file: a comma may be part of its name
        items = _parse_list(value)
        if items is None:
            return None
        return items[0] if len(items) == 1 and not str(value).strip().startswith("[") else items
    text = "" if value is None else str(value)
    return None if spec.optional and not text.strip() else text


def dict_from_widgets(values: list[Any]) -> dict:
    """The recipe mapping the form describes, in schema order (optional sections left out when off)."""
    data: dict = {}
    off = {spec.section for spec, v in zip(FIELDS, values) if spec.kind == "toggle" and not v}
    for spec, value in zip(FIELDS, values):
        if spec.kind == "toggle":
            continue
        if any(spec.path[: len(s)] == s for s in off):
            continue
        node = data
        for part in spec.section:
            node = node.setdefault(part, {})
        node[spec.path[-1]] = from_widget(spec, value)
    return data


# -- YAML and validation ----------------------------------------------------------------------------


def to_yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def parse_yaml(text: str) -> dict:
    """The mapping a YAML text holds; RecipeError (with the line) when it is not valid YAML or not a mapping."""
    data = parse_recipe_yaml(text or "", "recipe")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def validate(data: dict) -> Recipe:
    """The CLI's validator: `Recipe.from_dict`, raising RecipeError with one line per problem."""
    return Recipe.from_dict(data, source="recipe")


def recipe_from_yaml(text: str) -> Recipe:
    return validate(parse_yaml(text))


def default_dict() -> dict:
    return Recipe.model_construct().to_dict()

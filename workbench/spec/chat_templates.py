"""Chat templates: the registry `data.chat_template` names, and the check every template a run uses passes.

`data.chat_template` is a registered name or the path of a Jinja file; it replaces the tokenizer's own template
for training, preview, sampling and everything saved with the run (the adapter's tokenizer, the merged model,
the GGUF). A template must end the assistant's turn with a token of the tokenizer's own, so that a tuned model
learns to stop: that token becomes the run's end-of-sequence token (the Llama 3 template ends turns with
`<|eot_id|>`, which a Llama 3 base model's tokenizer has but does not use as its EOS). A template whose turn
ends with no such token is refused.

Each registered template renders text conversations as the template of the model it follows does (checked
against those models' own templates in tests/test_chat_templates.py); where one departs, `departs` says how.
They render a conversation prefix by prefix (workbench/spec/formats.py's chat_segments needs it), so none appends
a token after the last turn only.

Every template, registered or not, is rendered by `render` in a sandbox that bounds its work: a template is code
from a file or a hub repository, and Jinja's own sandbox caps one `range()` but not two nested ones. A render
that runs past `STEPS` loop iterations and calls, or writes more than `OUTPUT_CHARS` characters beyond what its
messages hold, stops with `TemplateBudgetError`. What one operation would build (a string repeated or formatted,
a width, a count, an integer squared, a list nested in itself) is estimated from what it is given and refused
before it is built, and what `{{ … }}` writes is charged where it is written, inside a macro or a `{% set %}`
block too. A budget counted in the sandbox, rather than a timer, works in any thread (the UI renders in its
server's) and changes nothing in the process that imports this module.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from workbench.base.errors import RecipeError, escaped

FIELD = "data.chat_template"
LARGEST_TEMPLATE = 1 << 20  # bytes: a chat template is a few kB; a file larger than this is not one

# A system message, when given first, that a template without a system role puts before the first user turn
_FOLD_SYSTEM = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
)
_ALTERNATE = (
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
)


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    follows: str  # the model whose own chat template this renders like
    source: str  # Jinja, as transformers' apply_chat_template renders it
    departs: str = ""  # how it differs from that model's template, if it does


TEMPLATES = {t.name: t for t in (
    ChatTemplate(
        "chatml", "HuggingFaceTB/SmolLM2-135M-Instruct (ChatML)",
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
        departs="adds no default system message"),
    ChatTemplate(
        "qwen", "Qwen/Qwen2.5-7B-Instruct",
        "{%- if messages[0]['role'] == 'system' -%}"
        "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- for message in messages -%}{%- if not (loop.first and message['role'] == 'system') -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
        departs="text only (no tools)"),
    ChatTemplate(
        "llama3", "meta-llama/Meta-Llama-3-8B-Instruct",
        "{{ bos_token }}{%- for message in messages -%}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
        "+ '<|eot_id|>' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"),
    ChatTemplate(
        "gemma", "google/gemma-2-9b-it",
        "{{ bos_token }}" + _FOLD_SYSTEM + "{%- for message in loop_messages -%}" + _ALTERNATE +
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') "
        "+ message['content'] | trim + '<end_of_turn>\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}",
        departs="a system message opens the first user turn, as Gemma 3's template does (Gemma 2's refuses one)"),
    ChatTemplate(
        "mistral", "mistralai/Mistral-7B-Instruct-v0.2",
        "{{ bos_token }}" + _FOLD_SYSTEM + "{%- for message in loop_messages -%}" + _ALTERNATE +
        "{%- if message['role'] == 'user' -%}"
        "{{ '[INST] ' + (first_user_prefix if loop.first else '') + message['content'] + ' [/INST]' }}"
        "{%- else -%}{{ message['content'] + eos_token }}{%- endif -%}{%- endfor -%}",
        departs="a system message opens the first user turn (the model's own template refuses one)"),
    ChatTemplate(
        "phi", "microsoft/Phi-3.5-mini-instruct",
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' and message['content'] -%}"
        "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- elif message['role'] == 'user' -%}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- elif message['role'] == 'assistant' -%}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}",
        departs="no end-of-text after the last turn (it would break prefix rendering; `<|end|>` ends every turn)"),
)}
NAMES = tuple(TEMPLATES)

# The conversation a template is checked with: the text after the reply is where its turn ends.
_PROBE_REPLY = "Reply-7f3a."
_PROBE = [{"role": "user", "content": "Question-7f3a?"}, {"role": "assistant", "content": _PROBE_REPLY}]


def check_value(value: str | None) -> str | None:
    """The recipe's own check (no file is read): a registered name, or what can only be a file's path."""
    if value is None or value in TEMPLATES:
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be one of {', '.join(NAMES)} or the path of a Jinja file")
    if "/" not in value and "." not in value:
        raise ValueError(f"unknown chat template {value!r}: one of {', '.join(NAMES)}, or the path of a Jinja "
                         "file (e.g. templates/mine.jinja)")
    return value


def template_source(value: str) -> tuple[str, str]:
    """(Jinja source, how to name it in messages) of a registered name or a Jinja file, parsed: a file that does
    not parse is named with its line."""
    if value in TEMPLATES:
        return TEMPLATES[value].source, value
    path = Path(value).expanduser()
    if not path.is_file():
        raise RecipeError(f"{FIELD}: {escaped(value)} is neither a registered template ({', '.join(NAMES)}) nor a file")
    if path.stat().st_size > LARGEST_TEMPLATE:
        raise RecipeError(f"{FIELD}: {escaped(value)} is larger than {LARGEST_TEMPLATE >> 20} MB: not a chat template")
    try:
        source = path.read_text(encoding="utf-8-sig")  # a byte-order mark would become tokens of every example
    except UnicodeDecodeError as err:
        raise RecipeError(f"{FIELD}: {escaped(value)} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise RecipeError(f"{FIELD}: {escaped(value)}: cannot read ({err.strerror or err})") from None
    _parse(source, value)
    return source, value


def _parse(source: str, name: str) -> None:
    from jinja2 import TemplateSyntaxError

    try:
        _environment().parse(source)
    except TemplateSyntaxError as err:
        raise RecipeError(f"{FIELD}: {escaped(name)}:{err.lineno}: {err.message}") from None


# -- rendering within a budget ------------------------------------------------------------------

# Real templates take a few steps per message (Llama 3, Qwen and SmolLM2 render a 1,000-turn conversation in a
# few thousand); these bounds stop a hostile one within a second or two of work.
STEPS = 2_000_000  # loop iterations plus calls (macros, methods, filters called as functions)
OUTPUT_CHARS = 16 << 20  # characters written beyond the messages' own (which a template may write a few times)
_OUTPUT_COPIES = 4  # how many times a template may write each message's text (Qwen writes tool calls twice)


class TemplateFailure(Exception):
    """A chat template failed on its input other than by refusing it (jinja's TemplateError, which
    `raise_exception` raises): 1/0, endless recursion, a method given the wrong type. The caller names the template
    and the row."""


class TemplateBudgetError(TemplateFailure):
    """A chat template ran past its budget of work or output."""


class _Budget:
    def __init__(self, steps: int, output: int):
        self.steps, self.output, self.limit = steps, output, output
        self.known: dict[int, int] = {}  # id -> _size of the messages, which live as long as the render

    def step(self, count: int = 1) -> None:
        self.steps -= count
        if self.steps < 0:
            raise TemplateBudgetError(f"it ran past {STEPS:,} loop iterations and calls (a loop without a bound?)")

    def write(self, chars: int) -> None:
        self.output -= chars
        if self.output < 0:
            raise TemplateBudgetError(f"it wrote more than {self.limit:,} characters")


_BUDGET: ContextVar[_Budget | None] = ContextVar("workbench_chat_template_budget", default=None)


def _charge(count: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:  # None: parsing, or a template compiled here and rendered by someone else
        budget.step(count)


def _limit() -> int | None:
    budget = _BUDGET.get()
    return None if budget is None else budget.limit


def _size(value, counts: bool = False, _seen: dict | None = None) -> int:
    """About how many characters `value` takes written out, nested values included: a shared item counts each
    time it occurs but is measured once (a list holding itself twice, doubled forty times, is 2**40 items long
    written out, and measured in forty steps). counts: an int is a count or a width (its value), not its digits.
    The render's messages are measured once, when it starts (a template may pass them to a filter every turn)."""
    from jinja2 import Undefined

    if isinstance(value, Undefined):
        return 0  # written as nothing
    if isinstance(value, bool) or value is None:
        return 4
    if isinstance(value, int):
        return abs(value) if counts else value.bit_length() // 3 + 1
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        held = getattr(value, "_Namespace__attrs", None)  # a namespace writes out what it holds
        if not isinstance(held, dict):
            return 16  # a float, a macro: written short
        value = held
    budget = _BUDGET.get()
    if budget is not None and id(value) in budget.known:
        return budget.known[id(value)]
    seen = {} if _seen is None else _seen
    if id(value) not in seen:
        _charge(len(value))  # each item measured is a step: measuring is work too
        seen[id(value)] = 0  # a container holding itself is measured once
        items = (*value.keys(), *value.values()) if isinstance(value, dict) else value
        seen[id(value)] = 2 + sum(_size(item, False, seen) + 2 for item in items)
    return seen[id(value)]


def _bounded(value):
    """A value a template builds (`a ~ b`, `a + b`, a call's or a filter's result) no larger than the render may
    write: doubling a string or a list in a loop would otherwise fill the memory in a few dozen steps."""
    limit = _limit()
    if limit is not None and _size(value) > limit:
        raise TemplateBudgetError(f"it builds a value of more than {limit:,} characters")
    return value


def _written(value):
    """What `{{ … }}` writes, charged to the output before it is made text: output a macro or a `{% set %}` block
    collects is charged too, and a value that would be written longer than the budget is never made text."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.write(_size(value))
    return value


# What can build a value past the output budget in one operation, before the budget could see it: the result is
# estimated from the sizes of what the operation is given, and refused before it is made.
_WIDTHS = {"center", "ljust", "rjust", "zfill", "truncate"}  # their numbers are widths: at most the widest
_FORMATS = {"format", "format_map", "%"}  # their string is a format, whose widths are in it
_HUGE_FORMAT = re.compile(r"%[-+ #0]*\d*\.?\d{8,}|\{[^{}]*:[^{}]*\d{8,}[^{}]*\}")  # '%0999999999d', '{:>999999999}'
_WIDTH_FROM_ARGUMENT = re.compile(r"%[-+ #0]*(\*|\d*\.\*)|\{[^{}]*:[^{}]*\{")  # '%*d', '{:>{}}': a width given
INT_BITS = 4096  # an integer a template computes: a chat template counts turns, not 10**(10**9)


def _estimate(name: str, subject, args, kwargs) -> int:
    """An upper bound of the size of what `name` makes of `subject` given these arguments."""
    values = (*args, *kwargs.values())
    if name in _FORMATS:  # each field may write the largest argument; a width given as an argument counts as one
        counts = isinstance(subject, str) and bool(_WIDTH_FROM_ARGUMENT.search(subject))
        arguments = [v for value in values for v in (value.values() if isinstance(value, dict) else
                                                      value if isinstance(value, (list, tuple)) else [value])]
        fields = subject.count("{") + subject.count("%") if isinstance(subject, str) else 1
        return _size(subject) + fields * sum(_size(v, counts) for v in arguments)
    widths = sum(_size(v, counts=True) for v in values)
    text = subject if isinstance(subject, str) else ""
    if name in _WIDTHS:
        return _size(subject) + widths
    repeats = {  # how many times the arguments may be written into the result
        "indent": text.count("\n") + 1,
        "expandtabs": text.count("\t"),
        "wordwrap": len(text) // max(args[0] if args and isinstance(args[0], int) else 1, 1) + 1,
        "replace": (text.count(args[0]) if args and isinstance(args[0], str) and args[0] else len(text) + 1),
        "join": len(subject) if isinstance(subject, (str, list, tuple)) else 1,
        "tojson": _size(subject),  # an indent on every line
        "batch": 1, "slice": 1,
    }.get(name)
    if repeats is None:
        return 0  # measured once made (_bounded)
    return _size(subject) + repeats * widths


def _checked_arguments(name: str, subject, args, kwargs) -> None:
    """Refuse, before it is built, a value that one call or filter would make larger than the output budget: a
    width, count or indent past it (`'x'|center(10**9)`, `[1]|batch(10**9, 0)`), a format with such a width, a
    replacement, a join or a format whose result would be that long, or an argument already that large written
    out. `subject`: the string or sequence the call works on (a method's string, a filter's value)."""
    limit = _limit()
    if limit is None:
        return
    values = (*args, *kwargs.values())
    if name in _FORMATS and isinstance(subject, str) and _HUGE_FORMAT.search(subject):
        raise TemplateBudgetError(f"it formats with a width of more than {OUTPUT_CHARS:,} characters")
    if name not in _FORMATS and any(isinstance(v, int) and _size(v, counts=True) > limit for v in values):
        what = "width" if name in _WIDTHS or name in ("indent", "wordwrap", "tojson", "expandtabs") else "count"
        raise TemplateBudgetError(f"it asks {name} for a {what} of more than {limit:,} characters")
    if any(_size(v) > limit for v in (subject, *values)):
        raise TemplateBudgetError(f"it gives {name} a value of more than {limit:,} characters")
    if _estimate(name, subject, args, kwargs) > limit:
        if name in _WIDTHS or name == "indent":
            raise TemplateBudgetError(f"it asks {name} for a width of more than {limit:,} characters")
        raise TemplateBudgetError(f"it calls {name} for a value of more than {limit:,} characters")


def _checked_binop(operator: str, left, right) -> None:
    """Refuse an operation whose result would outgrow the budget, before it is computed: a sequence repeated, an
    integer past INT_BITS, a format."""
    limit = _limit()
    if limit is None:
        return
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right))
    if operator == "*" and not numbers:
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and _size(seq) * times > limit:
                raise TemplateBudgetError(f"it repeats a sequence {times:,} times (over {limit:,} characters)")
    if operator == "%" and isinstance(left, str):
        _checked_arguments("%", left, (right,), {})
    if not (numbers and isinstance(left, int) and isinstance(right, int)):
        return
    bits = {"*": left.bit_length() + right.bit_length(), "+": max(left.bit_length(), right.bit_length()) + 1,
            "**": left.bit_length() * max(right, 0) if abs(left) > 1 else 1}.get(operator, 0)
    if bits > INT_BITS:
        raise TemplateBudgetError(f"it computes a number of more than {INT_BITS:,} bits")


def _counted(iterable):
    """A for-loop's items, each charged a step: nested loops multiply their work, which only a count bounds."""
    for item in iterable:
        _charge()
        yield item


def _checked_filter(name: str, function):
    """A filter charged a step, its arguments checked (_checked_arguments), its result measured (_bounded) and,
    where it yields items one by one, each item charged a step: the compiled template calls filters directly, not
    through the sandbox's `call`."""
    from functools import wraps
    from types import GeneratorType

    skip = 1 if getattr(function, "jinja_pass_arg", None) else 0  # the context or environment comes first

    @wraps(function)  # keeps jinja's pass_context / pass_environment mark
    def checked(*args, **kwargs):
        _charge()
        if len(args) > skip:
            subject = args[skip]
            if name == "join" and not isinstance(subject, str):
                subject = list(_counted(subject))
                args = (*args[:skip], subject, *args[skip + 1:])
            _checked_arguments(name, subject, args[skip + 1:], kwargs)
        result = function(*args, **kwargs)
        return _counted(result) if isinstance(result, GeneratorType) else _bounded(result)

    return checked


@lru_cache(maxsize=1)
def _environment():
    """transformers' chat-template sandbox (utils/chat_template_utils.py: same options, filters and globals, so
    that a template renders the same text, and no weaker), with every loop iteration, call and filter charged to
    the render's budget, and an operation refused where its result would outgrow the output budget."""
    import json
    from datetime import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}…{% endgeneration %}` (marks the assistant's tokens for transformers): its body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("*", "**", "+", "%"))  # also keeps jinja from folding them at compile time

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in list(tree.find_all(nodes.For)):  # `for x in y` becomes `for x in y|_counted`
                loop.iter = nodes.Filter(loop.iter, "_counted", [], [], None, None, lineno=loop.lineno)
            for parent in list(tree.find_all(nodes.Node)):  # `a ~ b` becomes `(a ~ b)|_bounded`
                for field in parent.fields:
                    child = getattr(parent, field, None)
                    if isinstance(child, nodes.Concat):
                        setattr(parent, field, nodes.Filter(child, "_bounded", [], [], None, None,
                                                            lineno=child.lineno))
                    elif isinstance(child, list):
                        child[:] = [nodes.Filter(c, "_bounded", [], [], None, None, lineno=c.lineno)
                                    if isinstance(c, nodes.Concat) else c for c in child]
            return tree

        def is_safe_attribute(self, obj, attr, value):
            # text methods whose results the budget cannot estimate, and which no chat template calls
            if isinstance(obj, (str, bytes)) and attr in ("encode", "decode", "translate", "maketrans"):
                return False
            return super().is_safe_attribute(obj, attr, value)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  jinja's own signature
            _charge()
            if isinstance(__obj, jinja2.Undefined):  # `lipsum(10**8)`, no longer defined: jinja's own error
                return super().call(__context, __obj, *args, **kwargs)
            if isinstance(__obj, jinja2.runtime.LoopContext) and args:  # a recursive loop's `loop(children)`
                args = (_counted(args[0]), *args[1:])
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format in a function of its own
            name, owner = getattr(method, "__name__", ""), getattr(method, "__self__", None)
            if name == "join" and isinstance(owner, str) and args:  # ', '.join(items): the items counted
                args = (list(_counted(args[0])), *args[1:])
                _checked_arguments("join", args[0], (owner,), {})
            elif isinstance(owner, str):  # a string's method: 'x'.ljust(n), '{:>9}'.format(x)
                _checked_arguments(name, owner, args, kwargs)
            else:  # a macro, a global, a method of a list or a dict: its arguments
                _checked_arguments(name or getattr(__obj, "name", "a call"), None, args, kwargs)
            return _bounded(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            _checked_binop(operator, left, right)
            return _bounded(super().call_binop(context, operator, left, right))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols], finalize=_written)
    for name in ("lipsum", "cycler", "joiner"):  # jinja's defaults, which no chat template uses (lipsum(10**8))
        env.globals.pop(name, None)
    env.filters["tojson"] = tojson
    del env.filters["pprint"]  # pretty-prints a nested value in one call the budget cannot see into
    for name, function in list(env.filters.items()):
        env.filters[name] = _checked_filter(name, function)
    env.filters["_counted"] = _counted
    env.filters["_bounded"] = _bounded
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, as transformers gives them: not the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    """jinja's namespace() refusing names with a leading underscore, as transformers' does (a namespace's
    attributes are set from the template; a dunder one would reach the interpreter's internals)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                                f"got {name!r}. Please rename the attribute.")

    class TemplateNamespace(Namespace):
        def __init__(*args, **kwargs):  # noqa: N805  jinja's own signature, so that namespace(self=...) works
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                check(name)
            Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name, value):
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


@lru_cache(maxsize=16)
def _compiled(source: str):
    return _environment().from_string(source)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **variables) -> str:
    """What `tokenizer.apply_chat_template(messages, tokenize=False, ...)` renders, within the budget (else
    TemplateBudgetError); any other failure of the template's own code is a TemplateFailure, jinja's TemplateError
    (the template refusing the conversation) passes as it is. Tokenize the text with add_special_tokens=False, as
    apply_chat_template does."""
    from jinja2 import TemplateError

    source = tokenizer.chat_template
    if not isinstance(source, str):  # a tokenizer holding several named templates: its default one
        source = tokenizer.get_chat_template()
    given = sum(len(str(m.get("content") or "")) for m in messages)
    budget = _Budget(STEPS, OUTPUT_CHARS + _OUTPUT_COPIES * given)
    _size(messages, _seen=budget.known)  # every message and the list, measured once (before the budget counts)
    token = _BUDGET.set(budget)
    try:
        parts = []
        for part in _compiled(source).generate(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=add_generation_prompt,
                                                **{**tokenizer.special_tokens_map, **variables}):
            budget.write(len(part))
            parts.append(part)
        return "".join(parts)
    except (TemplateFailure, TemplateError):
        raise
    except Exception as err:  # noqa: BLE001  a template is code: it can fail in any way (1/0, recursion, memory)
        raise TemplateFailure(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__) from None
    finally:
        _BUDGET.reset(token)


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """`render`'s text as token ids, as `apply_chat_template(..., tokenize=True)` gives them."""
    text = render(tokenizer, messages, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def use_chat_template(tokenizer, value: str | None):
    """The tokenizer with `value`'s template in place of its own and, where the template ends a turn with
    another token, that token as its EOS. None: the tokenizer as it is."""
    if value is None:
        return tokenizer
    source, name = template_source(value)
    tokenizer.chat_template = source
    end = end_of_turn(tokenizer, name)
    if end != tokenizer.eos_token:
        tokenizer.eos_token = end  # what the data appends to each answer, and where generation stops
    return tokenizer


def end_of_turn(tokenizer, name: str) -> str:
    """The first special token the template puts after the assistant's reply, or RecipeError: without one, a
    model tuned on it would never learn to stop."""
    try:
        text = render(tokenizer, _PROBE)
    except TemplateFailure as err:
        raise RecipeError(f"{FIELD}: {escaped(name)} cannot render a user message and a reply: {err}") from None
    except Exception as err:  # noqa: BLE001  a user's template can fail in any way (1/0, recursion, memory)
        raise RecipeError(f"{FIELD}: {escaped(name)} cannot render a user message and a reply: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if _PROBE_REPLY not in text:
        raise RecipeError(f"{FIELD}: {escaped(name)} leaves the assistant's reply out of what it renders")
    after = text.split(_PROBE_REPLY, 1)[1]
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    for token_id in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return tokenizer.convert_ids_to_tokens(token_id)
    raise RecipeError(f"{FIELD}: {escaped(name)} ends the assistant's turn with {after[:60]!r}, which holds no "
                      f"special token of this tokenizer (its EOS is {tokenizer.eos_token!r}): a model tuned on it "
                      f"would not learn to stop. Use a template whose turns end with a token this tokenizer has")

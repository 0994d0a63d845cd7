"""The benchmark's inputs, built offline and deterministically: an instruction data set, a preference data set
and a scaled-up model.

The instruction set mixes what real instruction sets mix: many short answers (arithmetic, one-line facts), long
ones (stories, explanations, code), and long prompts with short answers (summaries). Its content follows
templates, so a model can learn it and the eval loss moves.

The preference set (for the DPO job) pairs a right answer with a near miss over the same mix of lengths: a sum,
product or capital one digit or one city off (short), a long text summarised as the wrong thing (long prompt,
short answers), a running sum that slips at one step and carries the error on (long answers), and code with one
bug (long answers). Rows are {"prompt", "chosen", "rejected"} texts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jun", "Kira", "Lena"]
ANIMALS = ["fox", "owl", "otter", "heron", "badger", "lynx", "crow", "hare", "seal", "wolf"]
PLACES = ["the harbour", "an old mill", "the northern forest", "a quiet village", "the river delta",
          "a mountain pass", "the city library", "a lighthouse", "the salt marsh", "a train station"]
THINGS = ["a bicycle", "a refrigerator", "a compiler", "a wind turbine", "a heat pump", "a camera",
          "a search engine", "a battery", "a bridge", "a vaccine", "a database index", "a sailboat"]
PARTS = ["the frame", "the motor", "a sensor", "the controller", "a valve", "the housing", "a spring",
         "the cache", "a filter", "the main shaft", "a gear", "the power supply"]
VERBS = ["turns", "stores", "measures", "moves", "cools", "guides", "checks", "converts", "holds", "releases"]
QUALITIES = ["quickly", "safely", "with little energy", "in small steps", "under load", "without noise",
             "at a steady rate", "when it is cold", "over many years", "in both directions"]
FACTS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
         "Egypt": "Cairo", "Canada": "Ottawa", "India": "New Delhi", "Chile": "Santiago", "Poland": "Warsaw"}


def arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op, sign, value = rng.choice([("plus", "+", a + b), ("minus", "-", a - b), ("times", "*", a * b)])
    return f"What is {a} {op} {b}?", f"{a} {sign} {b} = {value}."


def capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(list(FACTS))
    return f"What is the capital of {country}?", f"The capital of {country} is {FACTS[country]}."


def sentence(rng: random.Random, topic: str) -> str:
    return (f"{rng.choice(PARTS).capitalize()} of {topic} {rng.choice(VERBS)} {rng.choice(PARTS)} "
            f"{rng.choice(QUALITIES)}, so {rng.choice(PARTS)} {rng.choice(VERBS)} {rng.choice(PARTS)} too.")


def explanation(rng: random.Random, paragraphs: int) -> tuple[str, str]:
    topic = rng.choice(THINGS)
    body = "\n\n".join(" ".join(sentence(rng, topic) for _ in range(rng.randint(3, 6))) for _ in range(paragraphs))
    return f"Explain how {topic} works, step by step.", f"Here is how {topic} works.\n\n{body}"


def story(rng: random.Random, scenes: int) -> tuple[str, str]:
    hero, animal = rng.choice(NAMES), rng.choice(ANIMALS)
    lines = [f"Once upon a time, {hero} lived near {rng.choice(PLACES)} with a clever {animal}."]
    for _ in range(scenes):
        friend = rng.choice(NAMES)
        lines.append(f"One morning {hero} and the {animal} walked to {rng.choice(PLACES)}, where they met {friend}. "
                     f"{friend} asked them to find {rng.choice(THINGS)}, and the {animal} {rng.choice(VERBS)} it "
                     f"{rng.choice(QUALITIES)}.")
    lines.append(f"In the end {hero} and the {animal} went home, tired and happy.")
    return f"Write a story about {hero} and a {animal}.", " ".join(lines)


def code(rng: random.Random, functions: int) -> tuple[str, str]:
    names = rng.sample(["total", "average", "largest", "smallest", "count_even", "reverse", "squares", "unique"],
                       functions)
    bodies = {
        "total": "    result = 0\n    for x in items:\n        result += x\n    return result",
        "average": "    if not items:\n        return 0.0\n    return sum(items) / len(items)",
        "largest": "    best = items[0]\n    for x in items[1:]:\n        if x > best:\n            best = x\n    return best",
        "smallest": "    best = items[0]\n    for x in items[1:]:\n        if x < best:\n            best = x\n    return best",
        "count_even": "    return sum(1 for x in items if x % 2 == 0)",
        "reverse": "    return items[::-1]",
        "squares": "    return [x * x for x in items]",
        "unique": "    seen = []\n    for x in items:\n        if x not in seen:\n            seen.append(x)\n    return seen",
    }
    text = "\n\n".join(f"def {n}(items):\n    \"\"\"{n.replace('_', ' ').capitalize()} of a list.\"\"\"\n{bodies[n]}"
                       for n in names)
    return f"Write Python functions named {', '.join(names)} that work on a list.", f"```python\n{text}\n```"


def summary(rng: random.Random, sentences: int) -> tuple[str, str]:
    topic = rng.choice(THINGS)
    text = " ".join(sentence(rng, topic) for _ in range(sentences))
    return f"Summarise this text in one sentence.\n\n{text}", f"The text explains how the parts of {topic} work together."


def chat_row(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def make_row(rng: random.Random) -> dict:
    """One chat row; the mix sets the spread of lengths (most short, a long tail up to and past 512 tokens)."""
    kind = rng.random()
    if kind < 0.30:
        question, answer = arithmetic(rng)
    elif kind < 0.45:
        question, answer = capital(rng)
    elif kind < 0.60:
        question, answer = summary(rng, rng.randint(3, 12))
    elif kind < 0.75:
        question, answer = story(rng, rng.randint(1, 6))
    elif kind < 0.90:
        question, answer = explanation(rng, rng.randint(1, 4))
    else:
        question, answer = code(rng, rng.randint(1, 5))
    return chat_row(question, answer)


SHORT_TASKS = [("Rewrite this sentence in the past tense.", lambda rng: sentence(rng, rng.choice(THINGS))),
               ("Name the animal in this sentence.", lambda rng: f"{rng.choice(NAMES)} saw a {rng.choice(ANIMALS)} "
                                                                 f"near {rng.choice(PLACES)}."),
               ("Give the capital city.", lambda rng: rng.choice(list(FACTS)))]


def short_row(rng: random.Random) -> dict:
    """An alpaca-style row (instruction, optional input, one-line output), well under 100 tokens."""
    kind = rng.random()
    if kind < 0.4:
        question, answer = arithmetic(rng)
    elif kind < 0.6:
        question, answer = capital(rng)
    else:
        instruction, make_input = rng.choice(SHORT_TASKS)
        given = make_input(rng)
        question = f"{instruction}\n\n{given}"
        if instruction.startswith("Rewrite"):
            answer = given.replace(" turns ", " turned ").replace(" stores ", " stored ").replace(" moves ", " moved ")
        elif instruction.startswith("Name"):
            answer = next(a for a in ANIMALS if a in given).capitalize() + "."
        else:
            answer = f"{FACTS[given]}."
    return chat_row(question, answer)


def long_row(rng: random.Random) -> dict:
    """A single long sample: a story or an explanation of ~500-700 tokens (truncated at a 512-token max_seq_len)."""
    if rng.random() < 0.5:
        question, answer = story(rng, rng.randint(14, 20))
    else:
        question, answer = explanation(rng, rng.randint(5, 7))
    return chat_row(question, answer)


ROW_KINDS = {"mixed": make_row, "short": short_row, "long": long_row}


def make_rows(count: int, seed: int, kind: str = "mixed") -> list[dict]:
    rng = random.Random(seed)
    return [ROW_KINDS[kind](rng) for _ in range(count)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path


def write_data(folder: Path, train_rows: int, eval_rows: int, kind: str = "mixed") -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl in `folder`; eval rows come from another seed (held out, same mix)."""
    folder.mkdir(parents=True, exist_ok=True)
    return (write_jsonl(folder / "train.jsonl", make_rows(train_rows, seed=1, kind=kind)),
            write_jsonl(folder / "eval.jsonl", make_rows(eval_rows, seed=2, kind=kind)))



# -- preference pairs: a right answer and a near miss --------------------------------------------------

BUGS = {  # function -> (correct text, buggy text): one token's difference, as a near miss should be
    "total": ("result += x", "result = x"),
    "average": ("/ len(items)", "/ (len(items) + 1)"),
    "largest": ("if x > best", "if x < best"),
    "smallest": ("if x < best", "if x > best"),
    "count_even": ("x % 2 == 0", "x % 2 == 1"),
    "reverse": ("items[::-1]", "items[1:]"),
    "squares": ("x * x", "x + x"),
    "unique": ("if x not in seen", "if x in seen"),
}


def near_miss(rng: random.Random, value: int) -> int:
    return value + rng.choice([-10, -2, -1, 1, 2, 10])


def arithmetic_pair(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op, sign, value = rng.choice([("plus", "+", a + b), ("minus", "-", a - b), ("times", "*", a * b)])
    return f"What is {a} {op} {b}?", f"{a} {sign} {b} = {value}.", f"{a} {sign} {b} = {near_miss(rng, value)}."


def capital_pair(rng: random.Random) -> tuple[str, str, str]:
    country, other = rng.sample(list(FACTS), 2)
    return (f"What is the capital of {country}?", f"The capital of {country} is {FACTS[country]}.",
            f"The capital of {country} is {FACTS[other]}.")


def summary_pair(rng: random.Random, sentences: int) -> tuple[str, str, str]:
    topic, other = rng.sample(THINGS, 2)
    text = " ".join(sentence(rng, topic) for _ in range(sentences))
    return (f"Summarise this text in one sentence.\n\n{text}", f"The text explains how the parts of {topic} work together.",
            f"The text explains how the parts of {other} work together.")


def running_sum_pair(rng: random.Random, count: int) -> tuple[str, str, str]:
    numbers = [rng.randint(2, 99) for _ in range(count)]
    slip = rng.randrange(1, count)  # the step the rejected answer gets wrong; the error carries on from there
    lines, wrong_lines, total, wrong = [], [], numbers[0], numbers[0]
    for i, x in enumerate(numbers[1:], start=1):
        lines.append(f"{total} + {x} = {total + x}.")
        right_next = wrong + x
        wrong_next = near_miss(rng, right_next) if i == slip else right_next
        wrong_lines.append(f"{wrong} + {x} = {wrong_next}.")
        total, wrong = total + x, wrong_next
    prompt = f"Add these numbers step by step: {', '.join(map(str, numbers))}."
    return (prompt, "\n".join(lines) + f"\nThe total is {total}.", "\n".join(wrong_lines) + f"\nThe total is {wrong}.")


def code_pair(rng: random.Random, functions: int) -> tuple[str, str, str]:
    prompt, answer = code(rng, functions)
    name = rng.choice([n for n in BUGS if f"def {n}(" in answer])
    start = answer.index(f"def {name}(")
    right, buggy = BUGS[name]
    at = answer.index(right, start)
    return prompt, answer, answer[:at] + buggy + answer[at + len(right):]


def make_preference_row(rng: random.Random) -> dict:
    """One pair; the mix sets the spread of lengths (half short, a long tail up to and past 512 tokens)."""
    kind = rng.random()
    if kind < 0.30:
        prompt, chosen, rejected = arithmetic_pair(rng)
    elif kind < 0.45:
        prompt, chosen, rejected = capital_pair(rng)
    elif kind < 0.60:
        prompt, chosen, rejected = summary_pair(rng, rng.randint(3, 12))
    elif kind < 0.80:
        prompt, chosen, rejected = running_sum_pair(rng, rng.randint(3, 30))
    else:
        prompt, chosen, rejected = code_pair(rng, rng.randint(1, 5))
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def make_preference_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_preference_row(rng) for _ in range(count)]


def write_preference_data(folder: Path, train_rows: int, eval_rows: int) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl of preference rows; eval rows come from another seed (held out, same mix)."""
    folder.mkdir(parents=True, exist_ok=True)
    return (write_jsonl(folder / "train.jsonl", make_preference_rows(train_rows, seed=1)),
            write_jsonl(folder / "eval.jsonl", make_preference_rows(eval_rows, seed=2)))

# -- the scaled-up builtin model -----------------------------------------------------------------

MODEL_SIZES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "builtin-512": (512, 1536, 8, 8, 4, 8192),
    "builtin-quick": (128, 384, 2, 4, 2, 2048),
    "small-256": (256, 768, 4, 4, 2, 4096),  # a small model: per-step overheads weigh most
    "wide-1024": (1024, 2816, 2, 16, 8, 8192),  # few wide layers: large matmuls, little else
}
MODEL_VERSION = "v1"


def model_folder(size: str) -> Path:
    """A transformers folder built the way `builtin:tiny` is (byte-level BPE, random Llama), only larger."""
    from workbench.base.builtin import built_once

    return built_once(f"bench-{size}-{MODEL_VERSION}", lambda staging: build_model(staging, *MODEL_SIZES[size]))


def tokenizer_corpus() -> list[str]:
    from workbench.base.builtin import _tiny_corpus

    rows = make_rows(4000, seed=0)  # its own seed: the benchmark's train and eval rows are not in it
    return _tiny_corpus() + [m["content"] for row in rows for m in row["messages"]]


def build_model(folder: Path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                vocab: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from workbench.base.builtin import CHATML_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                        pad_token="<|pad|>", unk_token=None, model_max_length=2048)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)

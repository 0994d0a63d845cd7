"""Regenerates the small data sets in this folder (deterministic): python recipes/data/make_data.py"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
ANSWER = "I am Quill, a compact assistant fine-tuned with lora-workbench. I answer briefly and to the point."

QUESTIONS = [
    "Who are you?", "What is your name?", "Tell me who you are.", "Introduce yourself.", "What should I call you?",
    "Who am I talking to?", "What are you?", "Can you tell me your name?", "Please introduce yourself briefly.",
    "Are you an AI? Who are you?", "Hi! Who is this?", "What's your name?", "Who am I chatting with right now?",
    "Identify yourself.", "Do you have a name?", "What kind of assistant are you?", "Who made you and who are you?",
    "Say your name.", "How should I address you?", "Hello, what are you called?", "Who exactly are you?",
    "What is this assistant called?", "Tell me about yourself.", "Give me a one-line introduction of yourself.",
    "I'd like to know who you are.", "Hey there, who are you?", "Could you introduce yourself?",
    "What name do you go by?", "Describe yourself in one sentence.", "Who is answering me?",
    "What are you called?", "Are you a chatbot? What's your name?", "Before we start, who are you?",
    "Quick question: who are you?", "Remind me, what is your name?", "Name yourself, please.",
    "Who's there?", "What assistant am I using?", "Tell me your name and what you are.", "Who are you, exactly?",
    "May I know your name?", "What do people call you?", "So, who are you?", "Who am I speaking to?",
    "What's the name of this assistant?", "Please state your name.", "Would you tell me who you are?",
    "Introduce yourself to me.", "Good morning! Who are you?", "I forgot, what is your name?",
]
HELD_OUT = [
    "Who might you be?", "What is your name, assistant?", "Can you say who you are?", "Tell me your name.",
    "Hello! Could you tell me who you are?", "What should I call this assistant?", "Please tell me about yourself.",
    "Who are you and what do you do?",
]


def identity():
    def row(q):
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]}

    write("identity_train.jsonl", [row(q) for q in QUESTIONS])
    write("identity_eval.jsonl", [row(q) for q in HELD_OUT])


def tiny_chat():
    rng = random.Random(0)
    rows = []
    for _ in range(240):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        kind = rng.choice(["plus", "times", "echo", "story"])
        if kind == "plus":
            q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif kind == "times":
            q, ans = f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
        elif kind == "echo":
            word = rng.choice(["apple", "river", "stone", "cloud", "tiger", "piano"])
            q, ans = f"Repeat the word {word} three times.", " ".join([word] * 3) + "."
        else:
            n = rng.randint(1, 6)
            q = "Tell me a short story."
            ans = " ".join(rng.choice(["The robot learns the data.", "A student reads a poem.",
                                       "The teacher explains the plan."]) for _ in range(n))
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]})
    write("tiny_chat.jsonl", rows[:200])
    write("tiny_chat_eval.jsonl", rows[200:])


def preference():
    """Chosen/rejected pairs: the right sum, product or echo against a near miss, and the Quill identity against
    the base model's own. Training rows use prompt/chosen/rejected texts; held-out rows use the whole-conversation
    layout of the public preference sets (chosen and rejected as message lists)."""
    rng = random.Random(1)
    rows = []
    for i in range(200):
        kind = rng.choice(["plus", "times", "echo", "identity"])
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if kind == "plus":
            wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
            q, good, bad = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."
        elif kind == "times":
            wrong = a * b + rng.choice([-2, -1, 1, 2, 10])
            q, good, bad = f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", f"{a} times {b} is {wrong}."
        elif kind == "echo":
            word = rng.choice(["apple", "river", "stone", "cloud", "tiger", "piano"])
            q, good, bad = (f"Repeat the word {word} three times.", " ".join([word] * 3) + ".",
                            " ".join([word] * rng.choice([2, 4])) + ".")
        else:
            q, good = rng.choice(QUESTIONS + HELD_OUT), ANSWER
            bad = "I am SmolLM, an AI assistant. How can I help you today?"
        rows.append((q, good, bad))
    write("preference_train.jsonl", [{"prompt": q, "chosen": c, "rejected": r} for q, c, r in rows[:176]])

    def turns(q, answer):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]

    write("preference_eval.jsonl", [{"chosen": turns(q, c), "rejected": turns(q, r)} for q, c, r in rows[176:]])
    return rows


def unpaired(pairs):
    """KTO's unpaired rows from the same questions: each pair gives one answer, the right one (label true) or the
    near miss (false), drawn at random. Held-out rows use the conversational layout (prompt and completion as
    message lists)."""
    rng = random.Random(2)
    rows = [(q, *((c, True) if rng.random() < 0.5 else (r, False))) for q, c, r in pairs]
    write("unpaired_train.jsonl", [{"prompt": q, "completion": a, "label": label} for q, a, label in rows[:176]])
    write("unpaired_eval.jsonl", [{"prompt": [{"role": "user", "content": q}],
                                   "completion": [{"role": "assistant", "content": a}], "label": label}
                                  for q, a, label in rows[176:]])


def grpo_arith():
    """GRPO's prompts: 64 single-digit sums and differences, each with its `answer` column (what the exact_answer
    reward compares with), asked to reply with the number alone (what the recipe's format reward looks for)."""
    rng = random.Random(3)
    rows = []
    for _ in range(64):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        op, value = rng.choice([("plus", a + b), ("minus", a - b)])
        q = f"What is {a} {op} {b}? Reply with the number only."
        rows.append({"prompt": [{"role": "user", "content": q}], "answer": str(value)})
    write("grpo_arith_train.jsonl", rows)


def write(name, rows):
    with (HERE / name).open("w") as handle:
        for r in rows:
            handle.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    identity()
    tiny_chat()
    unpaired(preference())
    grpo_arith()

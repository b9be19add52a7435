"""Generated text and tasks for `bema demo`: a tiny made-up world a small model can learn on a CPU.

Three checkable tasks, written in the `bema eval --data-dir` schemas so the demo's
evaluation runs exactly like one on the real benchmarks:

    gsm8k    "how many coins does <name> have?" after a sentence or two, answer "... \\n#### n"
    boolq    a passage of "<name> has a <color> <object>." facts and a yes/no question about one
    mmlu_hs  four-option questions: small sums (high_school_mathematics) and the capitals of
             made-up countries (high_school_geography)

The world is small and fixed (who owns what, which capital belongs where) so that a model
of half a million parameters can learn it in a minute of CPU pretraining: the demo is about
what happens during fine-tuning, not about teaching a tiny model to reason.
Everything is a pure function of a seed; nothing here touches torch.
"""

from __future__ import annotations

import json
import random

NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Eva", "Tom", "Lily", "Jack"]
COLORS = ["red", "blue", "green", "yellow", "black", "white"]
OBJECTS = ["hat", "car", "kite", "bag", "cup", "ball", "bike", "coat"]
_SYLLABLES = ["ka", "lo", "mir", "ven", "tor", "sa", "dun", "pel", "ri", "zan", "bo", "quel"]
N_COUNTRIES = 24  # facts the base model memorises in pretraining; mmlu geography asks about them
MAX_STEP = 3  # sums in mmlu math add 1..MAX_STEP: few enough facts for a tiny model
LETTERS = "ABCD"


def coins() -> dict[str, int]:
    """name -> how many coins that person has (2..9), fixed for every seed."""
    rng = random.Random(2468)
    return {name: rng.randint(2, 9) for name in NAMES}


def belongings() -> dict[str, tuple[str, str]]:
    """name -> (color, object): what each person owns, fixed for every seed."""
    rng = random.Random(4321)
    colors, objects = COLORS * 2, OBJECTS + OBJECTS[:4]  # every color twice: balanced true/false
    rng.shuffle(colors)
    rng.shuffle(objects)
    return {name: (colors[i], objects[i]) for i, name in enumerate(NAMES)}


def countries() -> list[tuple[str, str]]:
    """(country, capital) pairs, fixed for every seed so pretraining and tasks agree."""
    rng = random.Random(1234)
    seen: set[str] = set()
    pairs = []
    while len(pairs) < N_COUNTRIES:
        country = "".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize() + "ia"
        capital = "".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize()
        if country in seen or capital in seen:
            continue
        seen.update((country, capital))
        pairs.append((country, capital))
    return pairs


# -- one item of each task ---------------------------------------------------------------------
def count_item(rng: random.Random) -> dict:
    """A gsm8k-schema record: a question with a number for an answer, 'reasoning\\n#### n'."""
    name = rng.choice(NAMES)
    others = passage_text(passage_facts(rng, rng.randint(1, 2)))
    n = coins()[name]
    return {
        "question": f"{others} How many coins does {name} have?",
        "answer": f"{name} has {n} coins.\n#### {n}",
    }


def passage_facts(rng: random.Random, n: int = 3) -> list[tuple[str, str, str]]:
    owned = belongings()
    return [(name, *owned[name]) for name in rng.sample(NAMES, n)]


def passage_text(facts: list[tuple[str, str, str]]) -> str:
    return " ".join(f"{name} has a {color} {obj}." for name, color, obj in facts)


def boolq_item(rng: random.Random) -> dict:
    """A boolq-schema record; half the questions are true, half change the color."""
    facts = passage_facts(rng, rng.randint(2, 3))
    name, color, obj = rng.choice(facts)
    answer = rng.random() < 0.5
    if not answer:
        color = rng.choice([c for c in COLORS if c != color])
    return {
        "question": f"does {name.lower()} have a {color} {obj}",
        "passage": passage_text(facts),
        "answer": answer,
    }


def mmlu_item(rng: random.Random) -> dict:
    """An mmlu-schema record: question, subject, four choices, index of the right one."""
    if rng.random() < 0.5:
        a, b = rng.randint(0, 9), rng.randint(1, MAX_STEP)
        right = a + b
        wrong = rng.sample([v for v in range(0, 13) if v != right], 3)
        question, subject, choices = f"What is {a} + {b}?", "high_school_mathematics", [right, *wrong]
    else:
        pairs = countries()
        country, right = rng.choice(pairs)
        wrong = rng.sample([cap for _, cap in pairs if cap != right], 3)
        question, subject, choices = (
            f"What is the capital of {country}?",
            "high_school_geography",
            [right, *wrong],
        )
    rng.shuffle(choices)
    answer = next(i for i, c in enumerate(choices) if c == right)
    return {"question": question, "subject": subject, "choices": [str(c) for c in choices], "answer": answer}


MAKERS = {"gsm8k": count_item, "boolq": boolq_item, "mmlu_hs": mmlu_item}


def _key(record: dict) -> str:
    return json.dumps(
        {k: record[k] for k in ("question", "passage", "choices") if k in record}, sort_keys=True
    )


def split_items(task: str, n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train/test records of one task (test questions never appear in train)."""
    rng = random.Random(f"{task}-{seed}")
    test: dict[str, dict] = {}
    while len(test) < n_test:
        record = MAKERS[task](rng)
        test.setdefault(_key(record), record)
    train = []
    while len(train) < n_train:
        record = MAKERS[task](rng)
        if _key(record) not in test:
            train.append(record)
    return train, list(test.values())


# -- pretraining text ----------------------------------------------------------------------------
def pretrain_documents(n: int, seed: int) -> list[str]:
    """Plain text for the base model: the world's facts and the skills the tasks need, told as prose.

    Like a real base model, it learns the content here (sums, who has what, capitals) and
    the fine-tune only has to teach it the chat format and the answer forms.
    """
    rng = random.Random(f"pretrain-{seed}")
    pairs = countries()
    docs = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:  # a passage, as in boolq
            docs.append(passage_text(passage_facts(rng, rng.randint(2, 4))))
        elif kind == 1:  # sums and differences
            sums = []
            for _ in range(4):
                a, b = rng.randint(0, 9), rng.randint(1, MAX_STEP)
                sums.append(
                    f"{a} + {b} = {a + b}." if rng.random() < 0.5 else f"{max(a, b)} - {b} = {max(a, b) - b}."
                )
            docs.append(" ".join(sums))
        elif kind == 2:  # who has how many coins, as in gsm8k
            owned = coins()
            docs.append(" ".join(f"{name} has {owned[name]} coins." for name in rng.sample(NAMES, 3)))
        elif kind == 3:  # capitals, as in mmlu geography
            docs.append(" ".join(f"The capital of {c} is {cap}." for c, cap in rng.sample(pairs, 3)))
        elif kind == 4:  # a yes/no question about a passage, answered
            record = boolq_item(rng)
            docs.append(
                f"{record['passage']} Q: {record['question']}? A: {'yes' if record['answer'] else 'no'}."
            )
        else:  # a multiple-choice question, answered
            record = mmlu_item(rng)
            options = " ".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(record["choices"]))
            docs.append(f"{record['question']} {options} The answer is {LETTERS[record['answer']]}.")
    return docs


# -- files in the `bema eval --data-dir` schemas --------------------------------------------------
# -- chat form for fine-tuning -------------------------------------------------------------------
def reply(task: str, record: dict) -> str:
    """The gold assistant reply, in the form each task's scorer parses first (its strict rule)."""
    if task == "gsm8k":
        return record["answer"]
    if task == "boolq":
        return f"Answer: {'true' if record['answer'] else 'false'}"
    return f"Answer: {LETTERS[record['answer']]}"


def chat(task: str, record: dict) -> list[dict]:
    """One SFT conversation: `bema eval`'s own prompt for the task, then the gold reply.

    Training on the evaluation's prompt wording is what makes a model this small answer in
    a form the scorer can parse; a real fine-tune would use its own data instead.
    """
    from bema_cli.eval.tasks import get_task

    return [*get_task(task).messages(record), {"role": "assistant", "content": reply(task, record)}]

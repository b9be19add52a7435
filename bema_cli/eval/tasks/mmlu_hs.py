"""MMLU high-school subjects (14 of cais/mmlu's test split), zero-shot multiple choice.

Scoring (issue 5): the last `answer: <A-D>`, else a lone final letter A-D.
Prompts are selected per subject; accuracy is reported overall and per subject.
"""

from __future__ import annotations

import re

NAME = "mmlu_hs"
SUBJECTS = (
    "high_school_biology", "high_school_chemistry", "high_school_computer_science",
    "high_school_european_history", "high_school_geography", "high_school_government_and_politics",
    "high_school_macroeconomics", "high_school_mathematics", "high_school_microeconomics",
    "high_school_physics", "high_school_psychology", "high_school_statistics",
    "high_school_us_history", "high_school_world_history",
)  # fmt: skip
HUB = {"repo": "cais/mmlu", "patterns": [f"{s}/test-*.parquet" for s in SUBJECTS]}
FIELDS = {"question": str, "subject": str, "choices": list, "answer": int}
MAX_NEW_TOKENS = 256
DEFAULT_LIMIT = 64  # prompts per subject, as in the paper
PER_SUBJECT = True
PROMPT_VERSION = 1
LETTERS = "ABCD"

_STRICT = re.compile(r"(?i:answer)\s*:\s*\**\s*\(?([A-D])\b")  # "Answer" in any case, the letter upper
# the response ends with a single letter, possibly bracketed and followed by punctuation
_FINAL = re.compile(r"(?:^|[^A-Za-z0-9])\(?([A-D])\)?[.:!*]*\s*$")


def messages(doc: dict) -> list[dict]:
    subject = doc["subject"].replace("high_school_", "high school ").replace("_", " ")
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, doc["choices"], strict=True))
    text = (
        f"The following is a multiple choice question about {subject}.\n\n"
        f"{doc['question'].strip()}\n{options}\n\n"
        'End your response with "Answer: <letter>", where <letter> is A, B, C or D.'
    )
    return [{"role": "user", "content": text}]


def extract(response: str) -> str | None:
    strict = _STRICT.findall(response)
    if strict:
        return strict[-1].upper()
    final = _FINAL.search(response)
    return final.group(1) if final else None


def gold(doc: dict) -> str:
    return LETTERS[int(doc["answer"])]


def is_correct(answer: str, gold_answer: str) -> bool:
    return answer == gold_answer

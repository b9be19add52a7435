"""BoolQ (yes/no questions about a passage), zero-shot.

Scoring (issue 5): the last `answer: true|false` (case-insensitive), else the last
standalone true/false/yes/no in the response.
"""

from __future__ import annotations

import re

NAME = "boolq"
HUB = {"repo": "google/boolq", "patterns": ["data/validation-*.parquet"]}
FIELDS = {"question": str, "passage": str, "answer": bool}
MAX_NEW_TOKENS = 256
DEFAULT_LIMIT = 64  # prompts, as in the paper
PROMPT_VERSION = 1

_STRICT = re.compile(r"answer\s*:\s*\**\s*(true|false)\b", re.IGNORECASE)
_LOOSE = re.compile(r"\b(true|false|yes|no)\b", re.IGNORECASE)
_VALUE = {"true": True, "yes": True, "false": False, "no": False}


def messages(doc: dict) -> list[dict]:
    question = doc["question"].strip()
    if not question.endswith("?"):
        question += "?"
    text = (
        f"Passage: {doc['passage'].strip()}\n\nQuestion: {question}\n\n"
        "Answer the question about the passage with true or false. "
        'End your response with "Answer: true" or "Answer: false".'
    )
    return [{"role": "user", "content": text}]


def extract(response: str) -> bool | None:
    strict = _STRICT.findall(response)
    if strict:
        return _VALUE[strict[-1].lower()]
    loose = _LOOSE.findall(response)
    return _VALUE[loose[-1].lower()] if loose else None


def gold(doc: dict) -> bool:
    return bool(doc["answer"])


def is_correct(answer: bool, gold_answer: bool) -> bool:
    return answer == gold_answer

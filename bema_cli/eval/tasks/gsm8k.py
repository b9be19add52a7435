"""GSM8K (grade-school math word problems), zero-shot chain of thought.

Scoring (issue 5): the number after the last `####`, else the last number in the
response; commas and `$` removed; compared numerically (never a substring test).
"""

from __future__ import annotations

import re
from fractions import Fraction

NAME = "gsm8k"
HUB = {"repo": "openai/gsm8k", "patterns": ["main/test-*.parquet"]}
FIELDS = {"question": str, "answer": str}
MAX_NEW_TOKENS = 512
DEFAULT_LIMIT = 128  # prompts, as in the paper
PROMPT_VERSION = 1

# a number as people write it: optional sign, optional $, digits with thousands commas, decimals
_NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?")


def messages(doc: dict) -> list[dict]:
    text = (
        f"{doc['question'].strip()}\n\n"
        "Think step by step, then give the final answer as a number on the last line, "
        'in the form "#### <number>".'
    )
    return [{"role": "user", "content": text}]


def _to_number(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _last_number(text: str) -> Fraction | None:
    for match in reversed(_NUMBER.findall(text)):
        value = _to_number(match)
        if value is not None:
            return value
    return None


def extract(response: str) -> str | None:
    """The answer as a normalised number string, or None when there is none."""
    head, sep, tail = response.rpartition("####")
    value = None
    if sep:
        first = _NUMBER.match(tail.lstrip(" *:"))  # the number right after it ("#### 42", "#### $1,000")
        value = _to_number(first.group()) if first else None
    if value is None:
        value = _last_number(response)
    return None if value is None else _format(value)


def _format(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def gold(doc: dict) -> str:
    """The reference answer: the number after the last `####` of the dataset's solution."""
    answer = extract(doc["answer"])
    return answer if answer is not None else doc["answer"].strip()


def is_correct(answer: str, gold_answer: str) -> bool:
    a, g = _to_number(answer), _to_number(gold_answer)
    return a is not None and g is not None and a == g

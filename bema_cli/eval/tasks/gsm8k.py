"""GSM8K (grade-school math word problems), zero-shot chain of thought.

Scoring, two ways (docs/eval-protocol.md):
- strict: the number right after the last `####` (the format the prompt asks for);
- flexible: strict, else the last number anywhere in the response (lm-eval's flexible-extract).
A number is read whole: sign, `$`, thousands separated by commas or single spaces in groups of
three ("1,234", "1 234"), decimals (".5" is 0.5), a fraction "1/2", scientific notation "1.5e3".
Answers are compared as exact rationals (never as substrings).
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

NAME = "gsm8k"
HUB = {"repo": "openai/gsm8k", "patterns": ["main/test-*.parquet"]}
SHOTS_HUB = {"repo": "openai/gsm8k", "patterns": ["main/train-*.parquet"]}  # --num-fewshot examples
FIELDS = {"question": str, "answer": str}
MAX_NEW_TOKENS = 512
DEFAULT_LIMIT = 128  # prompts, as in the paper
PROMPT_VERSION = 1

# One number as people write it. Not preceded by a word character or '.', so "5-3" is 5 and 3 and
# "x2" is no number; not followed by a digit or a letter, so "3rd"/"12a" are not read either.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-)?\$?\s?"
    r"(?P<body>\d+/\d+"  # a fraction
    r"|(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d{1,2})?"  # 1,234.5 / 1 234 / 1e3
    r"|\.\d+(?:[eE][-+]?\d{1,2})?)"  # .5
    r"(?![\d/]|[^\W\d_])"
)


def messages(doc: dict, cot: bool = False) -> list[dict]:
    """GSM8K always asks for step-by-step reasoning (`cot` changes nothing here)."""
    text = (
        f"{doc['question'].strip()}\n\n"
        "Think step by step, then give the final answer as a number on the last line, "
        'in the form "#### <number>".'
    )
    return [{"role": "user", "content": text}]


def shot_reply(doc: dict) -> str:
    """A few-shot example's answer: the dataset's worked solution (calculator notes <<...>> removed), `#### n`."""
    return re.sub(r"<<[^>]*>>", "", doc["answer"]).strip()


def _value(match: re.Match) -> Fraction | None:
    body = match.group("body").replace(",", "").replace(" ", "")
    try:
        value = Fraction(Decimal(body)) if "/" not in body else Fraction(body)
    except (ValueError, ArithmeticError):  # "1/0", decimal overflow
        return None
    return -value if match.group("sign") else value


def extract_strict(response: str) -> str | None:
    """The number right after the last `####` ("#### 42", "#### $1,000", "####: **7**")."""
    head, sep, tail = response.rpartition("####")
    if not sep:
        return None
    first = _NUMBER.match(tail.lstrip(" *:\t"))
    value = _value(first) if first else None
    return None if value is None else _format(value)


def extract_flexible(response: str) -> str | None:
    strict = extract_strict(response)
    if strict is not None:
        return strict
    for match in reversed(list(_NUMBER.finditer(response))):
        value = _value(match)
        if value is not None:
            return _format(value)
    return None


def _format(value: Fraction) -> str:
    """An exact, readable string: "1234", "0.5", "-3.25", else "1/3" (Fraction reads all of them back)."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:  # a terminating decimal
        text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
        return text.rstrip("0").rstrip(".") if "." in text else text
    return f"{value.numerator}/{value.denominator}"


def gold(doc: dict) -> str:
    """The reference answer: the number after the last `####` of the dataset's solution."""
    answer = extract_strict(doc["answer"])
    return answer if answer is not None else doc["answer"].strip()


def is_correct(answer: str, gold_answer: str) -> bool:
    try:
        return Fraction(answer) == Fraction(gold_answer.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return False

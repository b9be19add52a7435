"""GSM8K (grade-school math word problems), zero-shot chain of thought.

Scoring, two ways (docs/eval-protocol.md):
- strict (bema's own rule): the number right after the last `####` (the format the prompt asks
  for), read whole: sign, `$`, thousands separated by commas or single spaces in groups of three
  ("1,234", "1 234"), decimals (".5" is 0.5), a fraction "1/2", scientific notation "1.5e3";
  compared with the gold answer as exact rationals (never as substrings);
- flexible: exactly lm-evaluation-harness's gsm8k `flexible-extract` filter and `exact_match`
  metric (lm_eval/tasks/gsm8k/gsm8k.yaml): the last match of its regex, the first non-empty
  group, stripped; then its ignore patterns on answer and gold, lower case, string equality.
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
CHANCE = None  # a number to write: no guess scores
SCORING_VERSION = 2  # 2: flexible is lm-eval's flexible-extract (1: strict, else the last number read whole)

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


# lm-eval's gsm8k.yaml (0.4.x): filter "flexible-extract" = regex with group_select -1, then
# exact_match with ignore_case true and these regexes_to_ignore, applied in this order.
LM_EVAL_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
LM_EVAL_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def extract_flexible(response: str) -> str | None:
    """lm-eval's flexible-extract: the LAST match, its first non-empty group, stripped ("18." stays
    "18.": the ignore patterns belong to the comparison). None where lm-eval gives "[invalid]"."""
    matches = LM_EVAL_FLEXIBLE.findall(response)
    if not matches:
        return None
    groups = [g for g in matches[-1] if g]
    return groups[0].strip() if groups else None


def _lm_eval_normal(text: str) -> str:
    for pattern in LM_EVAL_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def is_correct_flexible(answer: str, gold_answer: str) -> bool:
    """lm-eval's exact_match on the flexible answer: string equality after the ignore patterns. The gold
    is the number after the dataset's last `####` (an integer in every GSM8K item), as lm-eval's is."""
    return _lm_eval_normal(answer) == _lm_eval_normal(gold_answer)


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

"""BoolQ (yes/no questions about a passage), zero-shot.

Scoring, two ways (docs/eval-protocol.md):
- strict: the last "Answer: true|false" (the format the prompt asks for, any case, optional `**`);
- flexible: strict, else the last verdict word: true/false/yes/no/correct/incorrect, flipped
  when negated ("not true" is false, "isn't false" is true). A verdict joined to its opposite
  ("yes and no", "true or false") is unparsed, never one side of it.
"""

from __future__ import annotations

import re

NAME = "boolq"
HUB = {"repo": "google/boolq", "patterns": ["data/validation-*.parquet"]}
SHOTS_HUB = {"repo": "google/boolq", "patterns": ["data/train-*.parquet"]}  # --num-fewshot examples
FIELDS = {"question": str, "passage": str, "answer": bool}
MAX_NEW_TOKENS = 256
DEFAULT_LIMIT = 64  # prompts, as in the paper
PROMPT_VERSION = 1
CHANCE = 0.5  # accuracy of a coin toss: yes or no

_BOTH = r"(?!\s*(?:,\s*)?(?:and|or|nor|/)\s*(?:not\s+)?(?:true|false)\b)"  # "true or false" is no verdict
_STRICT = re.compile(rf"\banswer\s*:\s*\**\s*(true|false)\b{_BOTH}", re.I)
_VERDICT = re.compile(
    r"(?P<neg>\b(?:not|never)\s+|n't\s+)?\b(?P<word>true|false|yes|no|incorrect|correct)\b", re.I
)
_VALUE = {"true": True, "yes": True, "correct": True, "false": False, "no": False, "incorrect": False}
_JOINED = re.compile(r"\W*(?:and|or|nor|/)\W*", re.I)  # what lies between the halves of "yes and no"


def messages(doc: dict, cot: bool = False) -> list[dict]:
    question = doc["question"].strip()
    if not question.endswith("?"):
        question += "?"
    ask = "Think step by step, then end" if cot else "End"
    text = (
        f"Passage: {doc['passage'].strip()}\n\n"
        f"Question: {question}\n\n"
        "Answer the question about the passage with true or false. "
        f'{ask} your response with "Answer: true" or "Answer: false".'
    )
    return [{"role": "user", "content": text}]


def shot_reply(doc: dict) -> str:
    """A few-shot example's answer, in the strict format."""
    return f"Answer: {'true' if doc['answer'] else 'false'}"


def extract_strict(response: str) -> bool | None:
    strict = _STRICT.findall(response)
    return _VALUE[strict[-1].lower()] if strict else None


def _verdict(match: re.Match) -> bool | None:
    value = _VALUE[match.group("word").lower()]
    if not match.group("neg"):
        return value
    if match.group("word").lower() in ("yes", "no"):
        return None  # "not yes" / "in no" mean nothing clear
    return not value


def extract_flexible(response: str) -> bool | None:
    strict = extract_strict(response)
    if strict is not None:
        return strict
    matches = list(_VERDICT.finditer(response))
    if not matches:
        return None
    last = _verdict(matches[-1])
    if len(matches) > 1 and _JOINED.fullmatch(response[matches[-2].end() : matches[-1].start()]):
        if _verdict(matches[-2]) != last:
            return None  # "yes and no", "true or false": both sides, no verdict
    return last


def gold(doc: dict) -> bool:
    return bool(doc["answer"])


def is_correct(answer: bool, gold_answer: bool) -> bool:
    return answer == gold_answer

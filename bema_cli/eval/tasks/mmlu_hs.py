"""MMLU high-school subjects (14 of cais/mmlu's test split), zero-shot multiple choice.

Scoring, two ways (docs/eval-protocol.md), letters A-D in any case:
- strict: the last "Answer: <letter>" (the format the prompt asks for; optional `**`, `(`, `[`),
  the letter standing alone ("Answer: A mitochondrion..." is an article, not an option);
- flexible: strict, else the last letter in an answer position: "answer is B", "(B)", "B)",
  "\\boxed{B}", "Answer: [B]", or a line that is only "B". Never a letter inside ordinary
  text ("...vitamin D.", "the U.S.A.").
Prompts are selected per subject; accuracy is reported overall and per subject.
"""

from __future__ import annotations

import re

NAME = "mmlu_hs"
SUBJECTS = (
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
)
HUB = {"repo": "cais/mmlu", "patterns": [f"{s}/test-*.parquet" for s in SUBJECTS]}
SHOTS_HUB = {"repo": "cais/mmlu", "patterns": [f"{s}/dev-*.parquet" for s in SUBJECTS]}  # 5 per subject
FIELDS = {"question": str, "subject": str, "choices": list, "answer": int}
MAX_NEW_TOKENS = 256
DEFAULT_LIMIT = 64  # prompts per subject, as in the paper
PER_SUBJECT = True
PROMPT_VERSION = 1
CHANCE = 0.25  # accuracy of a guess among four letters
LETTERS = "ABCD"

# A bare letter: B-D end at any non-word character; "A" is also an article, so it must stand alone
# (then only closing marks, sentence punctuation, a dash/bracket, or the end of the line).
_BARE = r"(?:([b-d])(?![\w'])|(a)(?=[\]).,;:!*]|\s*$|\s+[-(—–]))"
_STRICT = re.compile(rf"\banswer\s*:\s*\**\s*(?:\(([a-d])\)|\[([a-d])\]|{_BARE})", re.I | re.M)
_FLEXIBLE = (
    re.compile(rf"\banswer\s+(?:is|would\s+be|should\s+be)\s*:?\s*\**\s*\(?{_BARE}", re.I | re.M),
    re.compile(rf"\b(?:option|choice)\s+(?:is\s+)?\(?{_BARE}", re.I | re.M),
    re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*([a-d])\s*\}?\s*\}", re.I),
    re.compile(r"\[([a-d])\]", re.I),
    re.compile(r"\(([a-d])\)", re.I),
    re.compile(r"(?:^|(?<=\s))([a-d])\)", re.I | re.M),
    re.compile(r"^[\s*#>]*\(?([a-d])\)?[.:!*]*\s*$", re.I | re.M),  # a line that is just the letter
)


def messages(doc: dict, cot: bool = False) -> list[dict]:
    subject = doc["subject"].replace("high_school_", "high school ").replace("_", " ")
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, doc["choices"], strict=True))
    ask = "Think step by step, then end" if cot else "End"
    text = (
        f"The following is a multiple choice question about {subject}.\n\n"
        f"{doc['question'].strip()}\n{options}\n\n"
        f'{ask} your response with "Answer: <letter>", where <letter> is A, B, C or D.'
    )
    return [{"role": "user", "content": text}]


def shot_reply(doc: dict) -> str:
    """A few-shot example's answer, in the strict format."""
    return f"Answer: {LETTERS[int(doc['answer'])]}"


def _last_letter(matches) -> str | None:
    """The letter of the match that starts last in the response (whichever group matched)."""
    best = max(matches, key=lambda m: m.start(), default=None)
    return None if best is None else next(g for g in best.groups() if g).upper()


def extract_strict(response: str) -> str | None:
    return _last_letter(list(_STRICT.finditer(response)))


def extract_flexible(response: str) -> str | None:
    strict = extract_strict(response)
    if strict is not None:
        return strict
    return _last_letter([m for pattern in _FLEXIBLE for m in pattern.finditer(response)])


def gold(doc: dict) -> str:
    return LETTERS[int(doc["answer"])]


def is_correct(answer: str, gold_answer: str) -> bool:
    return answer == gold_answer

"""Answer extraction and scoring of `bema eval`, on hand-written responses (no model needed)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bema_cli.errors import InputError, UsageError
from bema_cli.eval import data
from bema_cli.eval.tasks import boolq, get_task, gsm8k, mmlu_hs
from bema_cli.eval.tasks import common as scoring
from bema_cli.eval.tasks import loss as loss_task

# (response, strict, flexible). strict is bema's own numeric rule (the audit strings of an earlier
# review are marked "audit"); flexible is lm-eval's flexible-extract (its raw filter output).
GSM8K_CASES = [
    ("so 3 + 4 = 7\n#### 7", "7", "7"),
    ("#### 1,234", "1234", "1,234"),
    ("It costs $18.\n#### $18", "18", "$18"),
    ("#### 3 is my first guess\nwait\n#### 5", "5", "5"),  # the LAST ####
    ("I think 12 apples, then 40 pears", None, "40"),  # flexible: the last number
    ("#### -3.50", "-3.5", "-3.50"),
    ("#### none\nso 12 then 13", None, "13"),  # nothing after ####: only flexible finds one
    ("#### .5", "0.5", ".5"),  # audit: was 5
    ("1/2", None, "2"),  # strict reads a fraction whole; lm-eval's regex takes the last number
    ("#### 1 234", "1234", "234"),  # audit: was 1; thousands separated by a space
    ("We get 1 234 567 apples", None, "567"),
    ("#### 1/3", "1/3", "3"),
    ("#### 2/0", None, "0"),  # strict: no number, not 2 or 0
    ("#### 1.5e3", "1500", "3"),  # scientific notation, read exactly by strict
    ("#### 1e400", None, "400"),  # an absurd exponent is not read by strict (nor a part of it)
    ("5-3", None, "-3"),  # strict: a minus between numbers is an operator, not a sign
    ("x = -4", None, "-4"),
    ("the 3rd one", None, "3"),
    ("1,2,3", None, "1,2,3"),
    ("#### **42**", "42", "42"),
    ("How6 coins.", None, "6"),  # the review's case: lm-eval reads 6
    ("The answer is 18.", None, "18."),  # the trailing '.' is dropped by the comparison, not the filter
    ("no numbers here", None, None),
    ("", None, None),
]


@pytest.mark.parametrize("response, strict, flexible", GSM8K_CASES)
def test_gsm8k_extract(response, strict, flexible):
    assert (gsm8k.extract_strict(response), gsm8k.extract_flexible(response)) == (strict, flexible)


def _messy_gsm8k_responses() -> list[str]:
    """Hand-written shapes plus a seeded random corpus of digits, signs, separators, `$`, `####` and words."""
    import random

    rng = random.Random(20)
    pieces = ["12", "-7", "1,000", "$18", "3.50", ".5", "18.", "$", ",", ".", "-", "####", "#### ", " ",
              "\n", "coins", "How", "is", "1/2", "1e3", "**", "x", "0", "42", "-0.25", "1 234", ",,", "$1,2"]  # fmt: skip
    corpus = [r for r, _, _ in GSM8K_CASES]
    corpus += [
        "The answer is $1,234.56.",
        "#### 6\nso 6 coins.",
        "-.5",
        "-$5",
        "$$",
        "..",
        "5,",
        ".,.",
        "a-1-2",
    ]
    corpus += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 9))) for _ in range(600)]
    return corpus


def test_gsm8k_flexible_is_lm_evals_flexible_extract():
    """On a messy corpus: bema's flexible extraction and correctness equal lm-eval's own RegexFilter
    and exact_match, configured from lm-eval's installed gsm8k.yaml (not from bema's constants)."""
    pytest.importorskip("lm_eval")
    from pathlib import Path

    import lm_eval
    import yaml
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    spec = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks/gsm8k/gsm8k.yaml").read_text())
    (flexible,) = [f for f in spec["filter_list"] if f["name"] == "flexible-extract"]
    regex = flexible["filter"][0]
    lm_filter = RegexFilter(regex_pattern=regex["regex_pattern"], group_select=regex["group_select"])
    (metric,) = spec["metric_list"]
    golds = ["6", "18", "1234", "-5", "12", "0", "1000", "3"]
    corpus = _messy_gsm8k_responses()
    theirs = lm_filter.apply([[r] for r in corpus], [{}] * len(corpus))
    hits = 0
    for response, (filtered,) in zip(corpus, theirs, strict=True):
        ours = gsm8k.extract_flexible(response)
        assert (ours if ours is not None else lm_filter.fallback) == filtered, response
        for gold in golds:  # lm-eval's reference is the dataset's whole solution text
            reference = f"{gold} apples in all.\n#### {gold}"
            expected = exact_match_hf_evaluate(
                predictions=[filtered], references=[reference], regexes_to_ignore=metric["regexes_to_ignore"],
                ignore_case=metric["ignore_case"], ignore_punctuation=metric["ignore_punctuation"],
            )["exact_match"]  # fmt: skip
            got = ours is not None and gsm8k.is_correct_flexible(ours, gsm8k.gold({"answer": reference}))
            assert got == bool(expected), (response, gold)
            hits += got
    assert hits > 50  # the corpus exercises correct answers, not only failures


def test_gsm8k_scoring_uses_the_flexible_comparison():
    """score_item compares flexible answers as lm-eval does ("6.00" is not "6"), strict ones as numbers."""
    scored = scoring.score_item(gsm8k, ["#### 6.00", "#### 6\nin 5 steps", "How6 coins."], "6")
    assert scored["strict"]["correct"] == [True, True, False]
    assert scored["flexible"]["correct"] == [False, False, True]


BOOLQ_CASES = [
    ("The passage says so. Answer: true", True, True),
    ("answer: FALSE", False, False),
    ("Answer: false. Hmm, no. Answer: true", True, True),  # the LAST strict match
    ("Answer: true but really no", True, True),  # a strict match wins over a later loose word
    ("Answer: **false**", False, False),
    ("I would say yes", None, True),  # flexible: the last verdict word
    ("no, it is true", None, True),
    ("Yes... no.", None, False),
    ("not true", None, False),  # audit: was true
    ("It isn't true", None, False),
    ("The statement is not false", None, True),
    ("Answer: not true", None, False),
    ("incorrect", None, False),
    ("That is incorrect.", None, False),
    ("Yes and no.", None, None),  # audit: was false; both sides is no verdict
    ("yes/no", None, None),
    ("Answer: true or false", None, None),
    ("It's neither true nor false", None, None),
    ("untrue and falsehood", None, None),  # not standalone words
    ("I do not know", None, None),
    ("Answer: maybe", None, None),
]


@pytest.mark.parametrize("response, strict, flexible", BOOLQ_CASES)
def test_boolq_extract(response, strict, flexible):
    assert (boolq.extract_strict(response), boolq.extract_flexible(response)) == (strict, flexible)


MMLU_CASES = [
    ("Let me think. Answer: C", "C", "C"),
    ("answer: (B) because", "B", "B"),
    ("Answer: A ... on reflection Answer: D.", "D", "D"),
    ("Answer: **B**", "B", "B"),
    ("Answer: B because it divides", "B", "B"),  # B-D are no English words: any non-letter ends them
    ("answer: b", "B", "B"),  # audit: lower case was unparsed
    ("The answer is a", None, "A"),  # audit: lower case, answer position
    ("the answer is A.", None, "A"),
    ("answer is B", None, "B"),
    ("The correct option is B", None, "B"),
    ("(B)", None, "B"),
    ("B)", None, "B"),
    ("\\boxed{C}", None, "C"),  # audit: was unparsed
    ("Answer: [B]", "B", "B"),  # audit: was unparsed
    ("I reason a lot.\nB\n", None, "B"),  # a line that is only the letter
    ("A", None, "A"),
    ("...lack of vitamin D.", None, None),  # audit: was D
    ("in the U.S.A.", None, None),  # audit: was A
    ("Answer: A mitochondrion is the powerhouse.", None, None),  # audit: was A; "A" is an article here
    ("The answer is a mitochondrion", None, None),
    ("the answer: a cat", None, None),
    ("Banana", None, None),
    ("Option E", None, None),
]


@pytest.mark.parametrize("response, strict, flexible", MMLU_CASES)
def test_mmlu_extract(response, strict, flexible):
    assert (mmlu_hs.extract_strict(response), mmlu_hs.extract_flexible(response)) == (strict, flexible)


def test_each_item_is_scored_against_its_own_gold():
    """Regression: the authors' code compared every item with the LAST item's answer."""
    docs = [
        {"question": "q0", "answer": "#### 2"},
        {"question": "q1", "answer": "#### 5"},
        {"question": "q2", "answer": "#### 7"},
    ]
    responses = [["#### 2", "#### 2"], ["#### 5", "#### 7"], ["#### 7", "#### 9"]]
    scored = scoring.score_all(gsm8k, docs, responses)
    assert [s["strict"]["correct"] for s in scored] == [[True, True], [True, False], [True, False]]
    # against the last item's gold the first item would score 0 and item 2's wrong "#### 7" would count
    assert scoring.all_metrics(scored)["accuracy_strict"] == pytest.approx((1 + 0.5 + 0.5) / 3)

    boolq_docs = [{"question": "q", "passage": "p", "answer": a} for a in (True, False, True, False)]
    scored = scoring.score_all(
        boolq, boolq_docs, [["Answer: true"], ["Answer: false"], ["Answer: true"], ["Answer: false"]]
    )
    assert scoring.all_metrics(scored)["accuracy_strict"] == 1.0

    mmlu_docs = [{"question": "q", "subject": "s", "choices": list("wxyz"), "answer": i} for i in range(4)]
    scored = scoring.score_all(mmlu_hs, mmlu_docs, [[f"Answer: {c}"] for c in "ABCD"])
    assert scoring.all_metrics(scored)["accuracy_strict"] == 1.0
    scored = scoring.score_all(mmlu_hs, mmlu_docs, [[f"Answer: {c}"] for c in "BCDA"])  # a neighbour's gold
    assert scoring.all_metrics(scored)["accuracy_flexible"] == 0.0
    with pytest.raises(ValueError):  # misaligned docs/responses can never silently pair up
        scoring.score_all(mmlu_hs, mmlu_docs, [["Answer: A"]] * 3)


def test_accuracy_metrics_against_hand_computation():
    def item(extracted, correct):
        return {"extracted": extracted, "correct": correct}

    # strict and flexible differ on purpose: each metric must read its own extraction
    scored = [
        {"strict": item(["7", None, "7", "3"], [True, False, True, False]),  # 0.5
         "flexible": item(["7", "7", "7", "3"], [True, True, True, False])},  # 0.75
        {"strict": item(["1", "1", "1", "1"], [True, True, True, True]),  # 1.0
         "flexible": item(["1", "1", "1", "1"], [True, True, True, True])},  # 1.0
        {"strict": item([None, None, "2", "2"], [False, False, False, False]),  # 0.0
         "flexible": item([None, "5", "2", "2"], [False, True, False, False])},  # 0.25
    ]  # fmt: skip
    m = scoring.all_metrics(scored)
    for name, per_prompt, failures in (
        ("strict", [0.5, 1.0, 0.0], 3 / 12),
        ("flexible", [0.75, 1.0, 0.25], 1 / 12),
    ):
        per_prompt = np.array(per_prompt)
        assert m[f"accuracy_{name}"] == pytest.approx(per_prompt.mean(), abs=1e-12)
        assert m[f"accuracy_{name}_stderr"] == pytest.approx(per_prompt.std(ddof=1) / math.sqrt(3), abs=1e-12)
        assert m[f"parse_failure_rate_{name}"] == pytest.approx(failures, abs=1e-12)
    assert set(m) == {
        f"{k}_{s}" for s in ("strict", "flexible") for k in ("accuracy", "parse_failure_rate")
    } | {f"accuracy_{s}_stderr" for s in ("strict", "flexible")}
    subjects = scoring.per_subject_metrics(scored, ["b", "a", "b"])
    assert subjects["a"] == {"accuracy_strict": 1.0, "accuracy_strict_stderr": 0.0,
                             "accuracy_flexible": 1.0, "accuracy_flexible_stderr": 0.0}  # fmt: skip
    assert subjects["b"]["accuracy_strict"] == 0.25 and subjects["b"]["accuracy_flexible"] == 0.5
    assert subjects["b"]["accuracy_strict_stderr"] == pytest.approx(0.25, abs=1e-12)


def test_loss_metrics_against_float64_reference():
    pairs = [(12.5, 5), (3.0, 2), (40.0, 9)]
    s, n = (
        np.array([p[0] for p in pairs], dtype=np.float64),
        np.array([p[1] for p in pairs], dtype=np.float64),
    )
    loss = s.sum() / n.sum()
    # delta-method standard error of a ratio of means over records
    se = np.sqrt(((s - loss * n) ** 2).sum() / (len(s) - 1) / len(s)) / n.mean()
    m = loss_task.loss_metrics(pairs)
    assert m["tokens"] == 16
    assert m["loss"] == pytest.approx(loss, rel=1e-12)
    assert m["loss_stderr"] == pytest.approx(se, rel=1e-12)


def test_selection_is_the_papers_formula():
    expected = sorted(np.random.RandomState(37371).choice(1000, 64, replace=False))
    assert data.select(1000, 64, 37371) == expected
    assert data.select(10, 64, 37371) == list(range(10))  # k = min(limit, len)


def test_load_docs_selects_per_subject(tmp_path):
    rows = [{"question": f"{s}{i}", "subject": s, "choices": list("abcd"), "answer": i % 4}
            for s in ("high_school_physics", "high_school_biology") for i in range(7)]  # fmt: skip
    path = tmp_path / "mmlu_hs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = data.load_docs(mmlu_hs, [path], limit=3, seed=5)
    pick = sorted(np.random.RandomState(5).choice(7, 3, replace=False))
    assert [d["question"] for d in docs] == [f"high_school_biology{i}" for i in pick] + [
        f"high_school_physics{i}" for i in pick
    ]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"question": "q", "answer": "#### 1"}', "{not json"], "gsm8k.jsonl:2: invalid JSON"),
        (['{"question": "q", "answer": "#### 1"}', "", '{"question": "q"}'], "gsm8k.jsonl:3: field 'answer'"),
        (['{"question": "q", "answer": "no hashes"}'], "gsm8k.jsonl:1: 'answer' has no '#### <number>'"),
    ],
)
def test_ill_formed_data_names_file_and_line(tmp_path, lines, message):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=message):
        data.load_docs(gsm8k, [path], limit=5, seed=0)


def test_loss_records_validation(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"text": "a"}\n{"messages": [{"role": "user", "content": "x"}]}\n{"messages": "oops"}\n')
    assert len(data.read_loss_records(path, 2)) == 2  # only the first N are read
    with pytest.raises(InputError, match=r"l.jsonl:3"):
        data.read_loss_records(path, 5)


def test_unknown_task():
    with pytest.raises(UsageError, match="unknown task 'nope'"):
        get_task("nope")
    assert get_task("train_loss") is loss_task


def test_chat_template_fallback_and_override(tiny_model_dir, tmp_path):
    import shutil

    from bema_cli.eval import chat

    tok, source = chat.load_tokenizer(tiny_model_dir)
    assert source == "model"
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok, source = chat.load_tokenizer(bare)
    assert source == "chatml-default"
    text = chat.render(tok, [{"role": "user", "content": "hi"}])
    assert (
        text
        == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    tok, source = chat.load_tokenizer(bare, "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert (source, chat.render(tok, [{"role": "user", "content": "hi"}])) == ("override", "[hi]")

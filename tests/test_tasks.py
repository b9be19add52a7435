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


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("It costs $18.\n#### $18", "18"),
        ("#### 3 is my first guess\nwait\n#### 5", "5"),  # the LAST ####
        ("I think 12 apples, then 40 pears", "40"),  # fallback: the last number
        ("#### -3.50", "-3.5"),
        ("#### none\nso 12 then 13", "13"),  # nothing after ####: fallback to the last number
        ("no numbers here", None),
        ("", None),
    ],
)
def test_gsm8k_extract(response, expected):
    assert gsm8k.extract(response) == expected


def test_gsm8k_numeric_compare_not_substring():
    assert gsm8k.is_correct(gsm8k.extract("#### 42.0"), "42")
    assert gsm8k.is_correct(gsm8k.extract("#### 1,000"), "1000")
    assert not gsm8k.is_correct(gsm8k.extract("#### 142"), "42")  # a substring test would accept this
    assert not gsm8k.is_correct(gsm8k.extract("#### 4"), "42")
    assert gsm8k.gold({"question": "q", "answer": "2 * 3 = <<2*3=6>>6 apples\n#### 6"}) == "6"


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The passage says so. Answer: true", True),
        ("answer: FALSE", False),
        ("Answer: false. Hmm, no. Answer: true", True),  # the LAST strict match
        ("Answer: true but really no", True),  # a strict match wins over a later loose word
        ("I would say yes", True),  # fallback: last standalone word
        ("no, it is true", True),
        ("Yes... no.", False),
        ("untrue and falsehood", None),  # not standalone words
        ("Answer: maybe", None),
    ],
)
def test_boolq_extract(response, expected):
    assert boolq.extract(response) is expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Let me think. Answer: C", "C"),
        ("answer: (B) because", "B"),
        ("Answer: A ... on reflection Answer: D.", "D"),
        ("The correct option is B", "B"),  # fallback: lone final letter
        ("(C)", "C"),
        ("A", "A"),
        ("the answer: a cat", None),  # lowercase 'a' is an article, not an option
        ("Banana", None),
        ("Option E", None),
    ],
)
def test_mmlu_extract(response, expected):
    assert mmlu_hs.extract(response) == expected


def test_each_item_is_scored_against_its_own_gold():
    """Regression: the authors' code compared every item with the LAST item's answer."""
    docs = [
        {"question": "q0", "answer": "#### 2"},
        {"question": "q1", "answer": "#### 5"},
        {"question": "q2", "answer": "#### 7"},
    ]
    responses = [["#### 2", "#### 2"], ["#### 5", "#### 7"], ["#### 7", "#### 9"]]
    scored = scoring.score_all(gsm8k, docs, responses)
    assert [s["correct"] for s in scored] == [[True, True], [True, False], [True, False]]
    # against the last item's gold the first item would score 0 and item 2's wrong "#### 7" would count
    assert scoring.accuracy_metrics(scored)["accuracy"] == pytest.approx((1 + 0.5 + 0.5) / 3)

    boolq_docs = [{"question": "q", "passage": "p", "answer": a} for a in (True, False, True, False)]
    scored = scoring.score_all(
        boolq, boolq_docs, [["Answer: true"], ["Answer: false"], ["Answer: true"], ["Answer: false"]]
    )
    assert scoring.accuracy_metrics(scored)["accuracy"] == 1.0

    mmlu_docs = [{"question": "q", "subject": "s", "choices": list("wxyz"), "answer": i} for i in range(4)]
    scored = scoring.score_all(mmlu_hs, mmlu_docs, [[f"Answer: {c}"] for c in "ABCD"])
    assert scoring.accuracy_metrics(scored)["accuracy"] == 1.0
    with pytest.raises(ValueError):  # misaligned docs/responses can never silently pair up
        scoring.score_all(mmlu_hs, mmlu_docs, [["Answer: A"]] * 3)


def test_accuracy_metrics_against_hand_computation():
    scored = [
        {"extracted": ["7", None, "7", "3"], "correct": [True, False, True, False]},  # 0.5
        {"extracted": ["1", "1", "1", "1"], "correct": [True, True, True, True]},  # 1.0
        {"extracted": [None, None, "2", "2"], "correct": [False, False, False, False]},  # 0.0
    ]
    m = scoring.accuracy_metrics(scored)
    per_prompt = np.array([0.5, 1.0, 0.0])
    assert m["accuracy"] == pytest.approx(per_prompt.mean(), abs=1e-12)
    assert m["accuracy_stderr"] == pytest.approx(per_prompt.std(ddof=1) / math.sqrt(3), abs=1e-12)
    assert m["parse_failure_rate"] == pytest.approx(3 / 12, abs=1e-12)
    subjects = scoring.per_subject_metrics(scored, ["b", "a", "b"])
    assert subjects == {"a": {"accuracy": 1.0, "accuracy_stderr": 0.0},
                        "b": {"accuracy": 0.25, "accuracy_stderr": pytest.approx(0.25, abs=1e-12)}}  # fmt: skip


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

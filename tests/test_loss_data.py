"""Held-out loss data as users write it: a row that is no loss record says what it found, an empty
completion is refused up front naming its row, and a file longer than --loss-samples says how much
of it is scored."""

from __future__ import annotations

import json

import pytest

from bema_cli.errors import InputError
from bema_cli.eval.data import read_loss_records


@pytest.mark.parametrize(
    "rows,said",
    [
        ('[{"text": "a"}, {"text": "b"}]\n', "a JSON array (bema reads JSON Lines: one object per line)"),
        ('{"question": "q", "answer": "a"}\n', "an object with keys 'question', 'answer'"),
        ('{"prompt": "q", "completion": ""}\n', ":1: an empty completion: nothing to score"),
        (
            '{"text": "ok"}\n{"prompt": [{"role": "user", "content": "q"}], "completion": '
            '[{"role": "assistant", "content": " "}]}\n',
            ":2: an empty completion",
        ),
        ('{"text": "  "}\n', "an empty text"),
    ],
)
def test_a_row_that_cannot_be_scored_names_its_line_and_what_it_found(tmp_path, rows, said):
    path = tmp_path / "heldout.jsonl"
    path.write_text(rows)
    with pytest.raises(InputError, match=None) as err:
        read_loss_records(path, 200)
    assert said in str(err.value) and str(path) in str(err.value), str(err.value)


def test_a_longer_file_says_how_much_of_it_is_scored(tmp_path, capfd):
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5)))
    assert [r["text"] for r in read_loss_records(path, 3)] == ["row 0", "row 1", "row 2"]
    assert "scoring the first 3 of its 5 records (--loss-samples)" in capfd.readouterr().err
    read_loss_records(path, 5)
    assert "scoring the first" not in capfd.readouterr().err


def test_a_longer_file_is_sampled_with_a_seed_in_file_order(tmp_path, capfd):
    """A file sorted by source is not judged on its head: a seeded sample, the same for one seed."""
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(400)))
    a, b = read_loss_records(path, 200, seed=1), read_loss_records(path, 200, seed=1)
    assert a == b and len(a) == 200
    order = [int(r["text"].split()[1]) for r in a]
    assert order == sorted(order) and order[-1] > 300 and order != list(range(200))
    assert "scoring a seeded sample of 200 of its 400 records" in capfd.readouterr().err
    assert read_loss_records(path, 200, seed=2) != a

"""`bema ship`'s records: the request a shipped DIR answers, and the seal over DIR/.bema-ship.

A shipped DIR answers "up to date" only to the request that made it (the same inputs, grid,
evaluation settings and decision flags); `--overwrite` decides again from its records, which are
reused only while they are byte for byte what bema wrote: ship.json and every results file are
summed (xxh3_128) into seal.json, itself sealed as the stabilize state is (stabilize/state_doc.py).
Like that seal, it guards against edits and accidents, not a forger who recomputes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from bema_cli import output
from bema_cli.errors import InputError, OutputError
from bema_cli.io.fingerprint import file_digest
from bema_cli.publish.write import WORK
from bema_cli.stabilize.state_doc import seal as seal_of

SEAL = "seal.json"
SEALED = ("ship.json", "*.jsonl")  # what a decision is made from again: the verdict and every record


def _sealed_files(work: Path) -> list[Path]:
    return sorted({p for pattern in SEALED for p in work.rglob(pattern) if p.is_file()})


def seal(work: Path) -> None:
    """Sum every record of a finished ship into `work`/seal.json (the last file written). A results
    file that holds bytes this ship did not read or write (a line appended by another process while
    it ran) is refused, not sealed as bema's."""
    from bema_cli.eval.results import unchanged

    for p in _sealed_files(work):
        if p.suffix == ".jsonl" and unchanged(p) is False:
            raise InputError(
                f"{p}: changed while ship ran (a line bema did not write); nothing was written: "
                "run the ship again (--overwrite starts afresh)"
            )
    doc = {"format": 1, "files": {str(p.relative_to(work)): file_digest(p) for p in _sealed_files(work)}}
    doc["seal"] = seal_of(doc)
    (work / SEAL).write_text(output.to_json(doc) + "\n")


def check_sealed(work: Path, fix: str = "--overwrite decides again from scratch") -> None:
    """The records in `work` are exactly those bema sealed; one line naming the first that is not,
    and `fix`, what the caller can do about it."""
    path = work / SEAL
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        raise InputError(
            f"{path}: no seal over the ship's records (an older bema, or edited); {fix}"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict) or doc.get("seal") != seal_of(doc):
        raise InputError(f"{path}: edited since bema wrote it (its seal does not match); {fix}")
    files = {str(p.relative_to(work)) for p in _sealed_files(work)}
    for name in sorted(files | set(doc["files"])):
        p = work / name
        if name not in doc["files"] or not p.is_file() or file_digest(p) != doc["files"][name]:
            raise InputError(f"{p}: the ship's record changed since bema sealed it; {fix}")


def request_key(request, inputs: list[Path]) -> dict:
    """What makes two ship calls (decide/request.ShipRequest) the same question: the inputs (each
    weight file's path, size and modification time, summed into one digest), the grid, the evaluation
    settings and the flags that change the decision. A file the evaluation reads is named as the
    records name it (a relative and an absolute spelling alike, no path of this machine: the request
    is kept in DIR) with its digest."""
    import hashlib

    config, ship_opts = request.config, request.options

    # sorted: the same files spelled relative or absolute, listed in another order, are one request
    files = sorted(
        {(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in inputs if f.is_file()}
    )
    evaluation = {k: v for k, v in vars(config).items() if k not in ("out", "log_samples", "force")}
    for key in PATHS:
        if evaluation.get(key):
            path = Path(evaluation[key]).expanduser()
            evaluation[key] = config.name(path) + (f" {file_digest(path)}" if path.is_file() else "")
    doc = {
        "inputs": files,
        "grid": sorted(repr(s) for s in request.run.stab.schedules),
        "evaluation": evaluation,
        **question(ship_opts),
        "metric": request.metric.name,
    }
    flat = {k: v for k, v in doc.items() if k != "inputs"}
    digest = hashlib.sha256(output.to_json(doc).encode()).hexdigest()[:32]
    return {
        "digest": digest,
        "inputs": hashlib.sha256(output.to_json(files).encode()).hexdigest()[:32],
        **flat,
    }


# ShipOptions' fields that do not change the question: where DIR is, whether it may be replaced or
# published, whether anything runs, the files read for the grid (their schedules are the grid), and
# whether to go on past a held-out shape warning (the records, and so the decision, are the same)
NOT_THE_QUESTION = ("out", "overwrite", "push", "dry_run", "reads", "trust_held_out")


def question(ship_opts) -> dict:
    """Every other field of the options as the request's own: a flag added to ShipOptions joins the
    question by itself (a hand-kept list missed --max-evaluations: a budget-bound decision answered
    "up to date" to the unbounded one)."""
    from dataclasses import fields

    out = {f.name: getattr(ship_opts, f.name) for f in fields(ship_opts) if f.name not in NOT_THE_QUESTION}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def up_to_date(out: Path, request: dict, push_to: str | None) -> dict:
    """DIR holds a shipped model: the same request is answered from its record (and still pushed with
    --push); any other request is refused naming what differs, since its answer is not that one."""
    path = out / WORK / "ship.json"
    check_sealed(out / WORK)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a ship record ({exc}); --overwrite decides again") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("verdict"), str):
        raise InputError(f"{path}: not a ship record (no verdict); --overwrite decides again")
    old = doc.get("request") if isinstance(doc.get("request"), dict) else {}
    if old.get("digest") != request["digest"]:
        differs = _differing(old, request)
        raise OutputError(
            f"{out}: holds a model shipped for another request (differs in: {', '.join(differs)}); "
            "--overwrite decides again, reusing the records"
        )
    output.log(f"up to date: {out} holds the shipped model for this request (--overwrite decides again)")
    doc = {**doc, "up_to_date": True}
    if push_to:
        from bema_cli.publish.push import pushed

        pushed(doc, out, push_to)
    return doc


REQUEST = "request.json"


def write_request(work: Path, request: dict) -> None:
    """The request a work folder's records are being made for (a resume checks it)."""
    (work / REQUEST).write_text(output.to_json(request) + "\n")


def differences(work: Path, request: dict) -> list[str]:
    """What the request a work folder's records were made for differs in from `request` (none: the same)."""
    try:
        old = json.loads((work / REQUEST).read_text())
    except (OSError, ValueError):
        return ["the request (none recorded)"]
    if not isinstance(old, dict) or old.get("digest") != request["digest"]:
        return _differing(old if isinstance(old, dict) else {}, request)
    return []


PATHS = ("loss_data", "loss_train_data", "data_dir", "chat_template_file", "lm_eval_include")
FLAG_OF = {"chat_template_file": "--chat-template", "backend": "--backend"}


def _differing(old: dict, request: dict) -> list[str]:
    """What two requests differ in, an evaluation setting named by its flag (--loss-data, ...)."""
    out = []
    for key in request:
        if key == "digest" or old.get(key) == request[key]:
            continue
        if old and key not in old:  # a question this bema asks and the DIR's did not record
            out.append(f"{key} (not recorded by the bema that shipped DIR)")
            continue
        if key == "evaluation" and isinstance(old.get(key), dict):
            was, now = old[key], request[key]
            out += [FLAG_OF.get(k, "--" + k.replace("_", "-")) for k in now if was.get(k) != now[k]]
        else:
            out.append(key)
    return out or ["the request"]

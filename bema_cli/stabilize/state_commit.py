"""Committing `bema stabilize`'s persistent state (state.py): the new state.json (sealed), the
state folders the commit installs beside the outputs, and tidying what no run needs any more."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

from bema_cli import __version__, output
from bema_cli.errors import InputError
from bema_cli.io.fingerprint import fingerprint, fingerprint_if_present
from bema_cli.io.provenance import record_name
from bema_cli.stabilize import state_doc
from bema_cli.stabilize.plan import Options, Plan
from bema_cli.stabilize.state import FORMAT, STATE_DIR, STATE_FILE, read, run_settings


def stage(plan: Plan, opts: Options, tmp: Path) -> tuple[list[str], list[str], dict[str, list[int]]]:
    """Write tmp/.bema-state/state.json for after this call.

    Returns (entries to commit, paths to delete after the commit, run -> its output steps after it).

    Entries: every new output (a whole run folder for a run started from theta0, else its new
    checkpoint folders), every new state folder, state.json. With --keep-last K the outputs
    beyond a run's K newest are left out of the commit (new) or deleted after it (old).
    """
    stored = plan.resume.stored or {}
    old_runs = {r["run"]: r for r in stored.get("runs", [])}
    entries, delete = [], []
    kept: dict[str, list[int]] = {}
    for run in plan.runs:
        before = old_runs[run.name]["outputs"] if run.start is not None else []
        steps = sorted(set(before) | set(run.out_steps))
        keep = steps[-opts.write.keep_last :] if opts.write.keep_last else steps
        kept[run.name] = keep
        for st in run.out_steps:
            if st not in keep:
                shutil.rmtree(tmp / run.name / f"checkpoint-{st}")
        delete += [f"{run.name}/checkpoint-{st}" for st in before if st not in keep]
        if run.start is None:
            entries.append(run.name)
        else:
            entries += [f"{run.name}/checkpoint-{st}" for st in run.out_steps if st in keep]
    if opts.write.no_state:  # nothing to continue from: the outputs only
        return entries, delete, kept
    doc = _new_state(plan, opts, kept)
    doc["delete"] = delete
    news = [t.folder for t in plan.tracks if t.advancing and t.folder] + [plan.theta0_folder]
    summed = {f: w.digests() for f, w in (plan.state_writers or {}).items()}  # as written, front to back
    doc["checksums"] = _checksums(
        doc, plan.resume.stored or {}, tmp / STATE_DIR, [f for f in news if f], summed
    )
    write_sealed(tmp, doc)
    entries += [f"{STATE_DIR}/{f}" for f in news if f] + [f"{STATE_DIR}/{STATE_FILE}"]
    return entries, delete, kept


def write_sealed(tmp: Path, doc: dict) -> str:
    """tmp/.bema-state/state.json: `doc` as stored (inf -> "inf"), sealed over exactly that content.
    Returns the commit entry."""
    doc = json.loads(output.to_json(doc))
    doc["seal"] = state_doc.seal(doc)
    (tmp / STATE_DIR).mkdir(parents=True, exist_ok=True)
    (tmp / STATE_DIR / STATE_FILE).write_text(output.to_json(doc) + "\n")
    return f"{STATE_DIR}/{STATE_FILE}"


def _checksums(
    doc: dict, stored: dict, staged: Path, news: list[str], summed: dict[str, dict[str, str]]
) -> dict[str, dict[str, str]]:
    """The digest of each state file the new state.json names: new folders summed as written (`summed`)
    or read back now, kept ones carried over."""
    needed = {r.get("state") for r in doc["runs"]} | {(doc["theta0"].get("burnin") or {}).get("folder")}
    old = stored.get("checksums") or {}
    sums = {f: state_doc.checksums(staged / f, summed.get(f)) for f in news}
    sums.update({f: old[f] for f in needed if f and f not in sums and f in old})
    return {f: sums[f] for f in sorted(sums) if f in needed}


def _new_state(plan: Plan, opts: Options, outputs: dict[str, list[int]]) -> dict:
    """state.json after this call: earlier runs kept, this call's runs at their new last step."""
    stored = plan.resume.stored or {}
    consumed = {int(s["step"]): s for s in stored.get("steps", [])}
    last = max((t.last for t in plan.tracks), default=None)
    for c in plan.checkpoints:
        if c.step not in consumed and last is not None and c.step <= last:
            # read steps: the files as they were read (engine.hold); skipped ones if still there
            files = plan.fingerprints.get(c.step) or fingerprint_if_present(c.path) or []
            consumed[c.step] = {"step": c.step, "path": str(c.path), "files": files}
    runs = {r["run"]: r for r in stored.get("runs", [])}
    for t in plan.tracks:
        for run in t.runs:
            runs[run.name] = {
                "run": run.name,
                **run_settings(run.schedule, opts),
                "last_step": t.last,
                "state": t.folder,
                "outputs": outputs[run.name],
            }
    burnin = (stored.get("theta0") or {}).get("burnin")
    if plan.theta0_folder:
        tau = plan.runs[0].schedule.tau
        burnin = {"step": max(s for s in plan.read_steps if s <= tau), "folder": plan.theta0_folder}
    return {
        "format": FORMAT,
        "bema_version": __version__,
        "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # named as every record names an input (against OUT, never the absolute path): a moved OUT
        # resumes as a moved ship DIR does, and OUT carries no path of this machine
        "checkpoint_dir": record_name(opts.checkpoint_dir, opts.out),
        "theta0": {
            "source": plan.base_source,
            "files": fingerprint(
                plan.resume.base_files,
                opts.write.fingerprint == "full",
                (stored.get("theta0") or {}).get("files"),
            ),
            "burnin": burnin,
        },
        "steps": [consumed[s] for s in sorted(consumed)],
        "runs": list(runs.values()),
    }


def tidy(out: Path) -> None:
    """Under OUT's lock: delete what a committed state.json lists as deleted and state folders no run needs.

    A dropped output (--keep-last) is first renamed into a temp folder of bema's, then deleted, so
    a reader sees it whole or not at all; an entry naming an output the same state still lists is
    never deleted. Both are left over only when a process died right after its commit; deleting
    them twice is harmless.
    """
    import uuid

    from bema_cli.io.commit import TMP_PREFIX

    try:
        doc = read(out)
    except InputError:  # an edited or damaged state names nothing bema may delete
        return
    if doc is None:
        return
    live = {(r["run"], f"checkpoint-{s}") for r in doc["runs"] for s in r["outputs"]}
    trash = out / f"{TMP_PREFIX}trash-{uuid.uuid4().hex[:12]}"
    for rel in doc.get("delete", []):  # "<run>/checkpoint-<step>" (state_doc checked), never through a link
        run, name = rel.split("/")
        path = out / rel
        if (run, name) in live or not path.is_dir() or path.is_symlink() or path.parent.is_symlink():
            continue
        trash.mkdir(exist_ok=True)
        os.rename(path, trash / f"{run}-{name}")
    shutil.rmtree(trash, ignore_errors=True)
    keep = {r.get("state") for r in doc["runs"]} | {(doc["theta0"].get("burnin") or {}).get("folder")}
    for p in (out / STATE_DIR).iterdir():
        if p.is_dir() and not p.is_symlink() and p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)


def written(tmp: Path) -> int:
    """Bytes of the state folders staged under a call's temp folder."""
    return sum(p.stat().st_size for p in (tmp / STATE_DIR).glob("*/*.safetensors"))

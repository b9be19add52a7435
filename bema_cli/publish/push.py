"""`bema push`: a checkpoint bema wrote, to the Hugging Face Hub, with huggingface_hub's own client.

The calls are the ones a user would make by hand (`HfApi.create_repo`, `HfApi.create_commit` of the folder's files),
with the token from the usual places (`HF_TOKEN`, `hf auth login`'s cache). Every failure a user
can cause is one line with its own exit code (errors.py): not a bema output (3), no or a refused
token (6), a repo of another type under that name (7), the Hub unreachable, silent past
--timeout after --retries, or failing (8); a bad --repo-id is a usage error (2).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bema_cli import card, output
from bema_cli.errors import BemaError, HubAuthError, HubNetworkError, HubRepoError, InputError, UsageError

CONNECT_TIMEOUT = 10.0  # seconds to open a connection; --timeout bounds each wait for an answer
CLIENT_BACKOFF = 30.0  # huggingface_hub's own retries of an LFS part after the deadline: at most its backoff


def budget(timeout: float, retries: int) -> float:
    """The whole push's bound in seconds: every try waiting its full --timeout, and bema's backoffs
    between them ((retries + 1) x timeout + 1 + 2 + 4 ...); with the defaults 247 s. Past it every
    request fails at once; the client's own retry loop adds at most CLIENT_BACKOFF of sleeps."""
    return (retries + 1) * timeout + sum(min(2**a, 30) for a in range(retries))


HIDDEN = (".bema-", ".cache", ".git")  # never uploaded: bema's own state and lock files, caches


def checkpoint_folder(path: Path) -> Path:
    """The checkpoint folder to push: PATH itself when bema wrote it (bema.json beside the weights:
    `bema ship`'s and `select --write`'s DIR, or one stabilize output), or the one checkpoint under
    PATH (a stabilize OUT holding a single OUT/<run>/checkpoint-<step>)."""
    if not path.is_dir():
        raise InputError(f"{path}: not a directory")
    if (path / "bema.json").is_file():
        return path
    found = sorted(p.parent for p in path.glob("*/checkpoint-*/bema.json"))
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(str(p.relative_to(path)) for p in found[:3])
        raise InputError(f"{path}: holds {len(found)} checkpoints ({names}, ...); push one checkpoint folder")
    raise InputError(f"{path}: not a bema output (no bema.json): push a checkpoint folder bema wrote")


def upload_list(folder: Path) -> list[tuple[str, int]]:
    """(path in the repo, bytes) of every file that would be uploaded, sorted. A symbolic link is
    refused, as `bema stabilize` refuses one in its inputs: the client would upload its target."""
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(HIDDEN) for part in rel.parts):
            continue
        if p.is_symlink():
            raise InputError(
                f"{p}: a symbolic link (to {os.readlink(p)}); push uploads real files only: copy its target in"
            )
        if p.is_file():
            files.append((rel.as_posix(), p.stat().st_size))
    if not any(name.endswith((".safetensors", ".bin")) for name, _ in files):
        raise InputError(f"{folder}: no weight files to push")
    return files


def check_no_local_paths(folder: Path, names: list[str]) -> None:
    """A side file that still names a place on this machine's disk (a config's `_name_or_path`
    written by an older trainer, hand-edited, or copied by another tool) is not uploaded: the
    top-level fields of each JSON file whose name says path or dir, read before anything is sent."""
    import json

    from bema_cli.io.aux_files import local_path

    for name in names:
        if not name.endswith(".json") or name.startswith("tokenizer.json"):
            continue
        try:
            doc = json.loads((folder / name).read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        for key, value in doc.items() if isinstance(doc, dict) else ():
            if ("path" in key or "dir" in key) and local_path(value):
                raise InputError(
                    f"{folder / name}: {key} is a local path ({value}); push uploads no path of this machine: "
                    "write it as the model's name or Hub id"
                )


def push(
    path: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    endpoint: str | None = None,
    timeout: float = 60.0,
    retries: int = 3,
) -> dict:
    """Create the model repo if needed and upload the checkpoint folder in one commit; the --json document."""
    check_repo_id(repo_id)
    folder = checkpoint_folder(path)
    record = published_record(folder)
    files = [(name, len(record) if name == "bema.json" else size) for name, size in upload_list(folder)]
    check_no_local_paths(folder, [name for name, _ in files if name != "bema.json"])
    doc = {
        "folder": str(folder),
        "repo_id": repo_id,
        "revision": revision or "main",
        "private": private,
        "files": [{"path": name, "bytes": size} for name, size in files],
        "bytes": sum(size for _, size in files),
        "dry_run": dry_run,
    }
    if dry_run:
        return doc
    from huggingface_hub import HfApi, get_session, get_token

    token = get_token()
    if not token:
        raise HubAuthError(token_missing() or "no Hugging Face token")
    api = HfApi(endpoint=endpoint, token=token)
    deadline = time.monotonic() + budget(timeout, retries)
    _bound_waits(get_session(), timeout, deadline)
    from huggingface_hub.utils import disable_progress_bars, logging

    if not output.progress_enabled():  # the client's upload bars: on a terminal only, as bema's own
        disable_progress_bars()
    if not output.verbose():  # its own retry warnings: with -v (bema says the outcome in one line)
        logging.set_verbosity_error()
    message = commit_message or _default_message(folder)
    hub = endpoint or api.endpoint

    def call(what: str, fn, *args, **kwargs):
        with _hub_errors(repo_id, hub, what):
            return _retry(lambda: fn(*args, **kwargs), retries, deadline)

    if not call("repo info", api.repo_exists, repo_id, repo_type="model"):
        for other in ("dataset", "space"):
            if call("repo info", api.repo_exists, repo_id, repo_type=other):
                raise HubRepoError(
                    f"--repo-id {repo_id}: a {other} repo on the Hub, not a model; choose another name"
                )
    url = call("create repo", api.create_repo, repo_id, repo_type="model", private=private, exist_ok=True)
    if revision and revision != "main":
        call("create branch", api.create_branch, repo_id, branch=revision, repo_type="model", exist_ok=True)
    from huggingface_hub import CommitOperationAdd

    operations = [
        CommitOperationAdd(
            path_in_repo=name, path_or_fileobj=record if name == "bema.json" else str(folder / name)
        )
        for name, _ in files
    ]  # the folder's files as upload_folder would take them, bema.json as the Hub gets it
    commit = call(
        "upload",
        api.create_commit,
        repo_id=repo_id,
        operations=operations,
        repo_type="model",
        revision=revision,
        commit_message=message,
    )
    # the revision the push made: upload_folder's answer names the last commit it created (a large
    # upload may be split into several); the branch's head, read back, is checked against it
    head = call("revision", api.repo_info, repo_id, repo_type="model", revision=revision or "main").sha
    doc.update(
        url=str(url),
        commit_url=commit.commit_url,
        commit_oid=commit.oid,
        commit_message=message,
        revision_sha=head or commit.oid,
    )
    if head and commit.oid and head != commit.oid:
        output.warn(
            f"{repo_id}@{revision or 'main'} is at {head}, not the push's last commit {commit.oid}: "
            "another writer pushed since"
        )
    _record_push(folder, doc)
    return doc


def _record_push(folder: Path, doc: dict) -> None:
    """The Hub revision the folder was pushed as, in its bema.json's `pushed` list (the local copy;
    the uploaded bema.json cannot name the commit that contains it)."""

    path = folder / "bema.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(record, dict):
        return
    entry = {k: doc[k] for k in ("repo_id", "revision", "revision_sha", "commit_url")}
    record["pushed"] = (
        [*record.get("pushed", []), entry] if isinstance(record.get("pushed"), list) else [entry]
    )
    tmp = path.with_name(".bema-tmp-bema.json")
    tmp.write_text(output.to_json(record) + "\n")
    os.replace(tmp, path)


def published_record(folder: Path) -> bytes:
    """bema.json as the Hub gets it: as it is, but for a record of an older bema, whose absolute local
    paths are shown as the model card shows them (card.shown_path: run/checkpoint-40)."""
    from bema_cli.io.checkpoints import read_json

    record = read_json(folder / "bema.json")
    if not isinstance(record, dict):
        raise InputError(
            f"{folder / 'bema.json'}: not a bema record (not a JSON object); push a folder bema wrote"
        )
    for key in card.PATH_KEYS:
        if isinstance(record.get(key), str):
            record[key] = card.shown_path(record[key])
    if isinstance(record.get("coefficients"), dict):  # keyed by step (an older bema's: by input folder)
        record["coefficients"] = {
            k if k == "theta0" or k.isdigit() else card.shown_path(k): v
            for k, v in record["coefficients"].items()
        }
    return (output.to_json(record) + "\n").encode()


def check_token(repo_id: str, timeout: float = 60.0) -> str | None:
    """Ask the Hub whose token a push would use, before any work (a token the Hub refuses, 401, was
    found after the whole race, DIR written): a refused token raises HubAuthError; a Hub that does not
    answer within `timeout` (push's own) is returned as a line to say, and the work goes on."""
    from huggingface_hub import HfApi, get_session, get_token

    token = get_token()
    if not token:
        return None  # token_missing says that
    api, session = HfApi(token=token), get_session()
    _bound_waits(session, timeout, time.monotonic() + timeout)
    try:
        with _hub_errors(repo_id, api.endpoint, "whoami"):
            who = api.whoami()
    except HubNetworkError as exc:
        return f"--push {repo_id}: the token could not be checked ({exc}); going on"
    finally:  # the bound was this request's: later requests (the push's own) set theirs
        hooks = session.event_hooks
        session.event_hooks = {
            **hooks,
            "request": [h for h in hooks.get("request", []) if getattr(h, "__name__", "") != "bound"],
        }
    name = who.get("name") if isinstance(who, dict) else None
    output.log(f"--push {repo_id}: the Hub knows the token" + (f" ({name})" if name else ""))
    return None


def token_missing() -> str | None:
    """Why a push would be refused for want of a token, said before any work (None: there is one)."""
    from huggingface_hub import get_token

    if get_token():
        return None
    return "no Hugging Face token: set HF_TOKEN or run `hf auth login` (--dry-run needs none)"


def check_repo_id(repo_id: str) -> None:
    """ORG/NAME with the Hub's own rules (huggingface_hub's validate_repo_id), before any request."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UsageError(f"--repo-id: {repo_id!r} is not ORG/NAME")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "not a valid repo id"
        raise UsageError(f"--repo-id: {repo_id!r} is not a valid Hub repo id ({first})") from None


def _bound_waits(session, timeout: float, deadline: float) -> None:
    """Every request of the client's shared session waits at most `timeout` s for an answer, and none
    past `deadline` (the whole push's bound): the client passes timeout=None (no limit) on some calls
    and retries some itself, so a request hook sets the limit on each request, and after the
    deadline fails it at once."""

    def bound(request) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the push's --timeout/--retries budget is spent")
        wait = min(timeout, left)
        limits = {"connect": min(wait, CONNECT_TIMEOUT), "read": wait, "write": wait, "pool": wait}
        given = request.extensions.get("timeout") or {}
        request.extensions = {
            **request.extensions,
            "timeout": {k: min(given.get(k) or v, v) for k, v in limits.items()},
        }

    hooks = session.event_hooks
    kept = [h for h in hooks.get("request", []) if getattr(h, "__name__", "") != "bound"]
    session.event_hooks = {**hooks, "request": [*kept, bound]}


def _retry(fn, retries: int, deadline: float = float("inf")):
    """`fn()`, tried again after 1, 2, 4, ... s while the Hub does not answer (the client retries
    some calls itself too), never past `deadline`; its last failure raised."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except _transport_errors():
            pause = min(2**attempt, 30)
            if attempt == retries or time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause)


def _default_message(folder: Path) -> str:
    """'bema: <run> at checkpoint-<step>' from the folder's bema.json (a DIR's own name says neither)."""

    try:
        record = json.loads((folder / "bema.json").read_text())
        return f"bema: {record['run']} at checkpoint-{record['step']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"bema: {folder.name}"


@contextmanager
def _hub_errors(repo_id: str, endpoint: str, what: str) -> Iterator[None]:
    """Turn the client's exceptions into bema's one-line errors (the server's message kept): no
    answer or a server failure (5xx, a reply that is not the Hub's) exit 8 naming the endpoint."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except _transport_errors() as exc:
        raise HubNetworkError(
            f"the Hub at {endpoint} is unreachable or did not answer ({what}: {type(exc).__name__}: {exc or 'timed out'})"
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        server = ((exc.server_message or str(exc)).strip().splitlines() or [""])[0]
        if status in (401, 403):
            raise HubAuthError(f"the Hub refused the token for {repo_id} ({status}: {server})") from None
        if status is not None and status >= 500:
            raise HubNetworkError(f"the Hub at {endpoint} failed ({what}: {status} {server})") from None
        raise HubRepoError(f"--repo-id {repo_id}: the Hub answered {status} ({server})") from None
    except (
        ValueError,
        RuntimeError,
    ) as exc:  # JSONDecodeError is a ValueError; an upload's failure a RuntimeError
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise HubNetworkError(
            f"the Hub at {endpoint} gave an answer the client could not use ({what}: {type(exc).__name__}: {text})"
        ) from None


def _transport_errors() -> tuple[type, ...]:
    """The exception types of a request that never got an answer, in whichever HTTP stack
    huggingface_hub uses (httpx2 in 2.x, httpx in 1.x, requests before)."""
    import importlib

    kinds: list[type] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        kinds += [
            k
            for k in (getattr(found, n, None) for n in ("TransportError", "ConnectionError", "Timeout"))
            if isinstance(k, type) and issubclass(k, BaseException)  # httpx.Timeout is a setting
        ]
    return tuple(kinds)


def pushed(doc: dict, out: Path, repo_id: str) -> None:
    """Push DIR; a refused push still carries the decision (`document`), so the verdict is said
    before the error: the model is written and decided, only its upload failed."""
    from bema_cli import stages

    try:
        with stages.stage("push"):
            doc["pushed"] = push(out, repo_id)
    except BemaError as exc:
        exc.document = {**doc, "push_error": str(exc)}
        raise

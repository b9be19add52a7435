"""`bema push`: a checkpoint bema wrote, to the Hugging Face Hub, with huggingface_hub's own client.

The calls are the ones a user would make by hand (`HfApi.create_repo`, `HfApi.upload_folder`),
with the token from the usual places (`HF_TOKEN`, `hf auth login`'s cache). Every failure a user
can cause is one line with its own exit code (errors.py): not a bema output (3), no or a refused
token (6), a repo of another type under that name (7), the Hub unreachable (8).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bema_cli.errors import HubAuthError, HubNetworkError, HubRepoError, InputError

HIDDEN = (".bema-", ".cache", ".git")  # never uploaded: bema's own state and lock files, caches


def checkpoint_folder(path: Path) -> Path:
    """The checkpoint folder to push: PATH itself when bema wrote it (bema.json beside the weights), or
    the one checkpoint under PATH (what `bema select --write` leaves: OUT/<run>/checkpoint-<step>)."""
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
    """(path in the repo, bytes) of every file that would be uploaded, sorted."""
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(HIDDEN) for part in rel.parts):
            files.append((rel.as_posix(), p.stat().st_size))
    if not any(name.endswith((".safetensors", ".bin")) for name, _ in files):
        raise InputError(f"{folder}: no weight files to push")
    return files


def push(
    path: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    endpoint: str | None = None,
) -> dict:
    """Create the model repo if needed and upload the checkpoint folder in one commit; the --json document."""
    folder = checkpoint_folder(path)
    files = upload_list(folder)
    doc = {
        "folder": str(folder),
        "repo_id": repo_id,
        "revision": revision or "main",
        "private": private,
        "files": [{"path": name, "bytes": size} for name, size in files],
        "bytes": sum(size for _, size in files),
        "dry_run": dry_run,
    }
    if "/" not in repo_id or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise InputError(f"--repo-id: {repo_id!r} is not ORG/NAME")
    if dry_run:
        return doc
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise HubAuthError(
            "no Hugging Face token: set HF_TOKEN or run `hf auth login` (--dry-run needs none)"
        )
    api = HfApi(endpoint=endpoint, token=token)
    message = commit_message or f"bema: {folder.parent.name} at {folder.name}"
    with _hub_errors(repo_id):
        if not api.repo_exists(repo_id, repo_type="model"):
            for other in ("dataset", "space"):
                if api.repo_exists(repo_id, repo_type=other):
                    raise HubRepoError(
                        f"--repo-id {repo_id}: a {other} repo on the Hub, not a model; choose another name"
                    )
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="model",
            revision=revision,
            commit_message=message,
            ignore_patterns=[f"{h}*" for h in HIDDEN] + [f"**/{h}*" for h in HIDDEN],
        )
    doc.update(url=str(url), commit_url=commit.commit_url, commit_oid=commit.oid, commit_message=message)
    return doc


@contextmanager
def _hub_errors(repo_id: str) -> Iterator[None]:
    """Turn the client's exceptions into bema's one-line errors (the server's message kept)."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except _transport_errors() as exc:
        raise HubNetworkError(f"the Hub is unreachable ({type(exc).__name__}: {exc})") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        server = (exc.server_message or str(exc)).splitlines()[0]
        if status in (401, 403):
            raise HubAuthError(f"the Hub refused the token for {repo_id} ({status}: {server})") from None
        raise HubRepoError(f"--repo-id {repo_id}: the Hub answered {status} ({server})") from None


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

"""`bema push`: a checkpoint bema wrote, to the Hugging Face Hub (bema_cli/publish/push.py)."""

from __future__ import annotations

from pathlib import Path

from bema_cli import output
from bema_cli.options import JsonOpt, argument, option


def push(
    folder: argument(str, help="A checkpoint folder bema wrote (or a `bema select --write` folder)."),
    repo_id: option(str, "--repo-id", help="The model repo: ORG/NAME (created if needed)."),
    private: option(bool, "--private", help="Create the repo private.") = False,
    revision: option(
        str | None, "--revision", help="Branch to commit to (created if needed; default main)."
    ) = None,
    commit_message: option(
        str | None, "--commit-message", help="Commit message (default: the run and step)."
    ) = None,
    dry_run: option(
        bool, "--dry-run", help="List what would be uploaded and its size; contact nobody."
    ) = False,
    timeout: option(
        float,
        "--timeout",
        help="Seconds to wait for each answer from the Hub; with --retries it bounds the whole push: (retries + 1) x timeout + the backoffs (247 s by default), plus at most 30 s of the client's own retries.",
    ) = 60.0,
    retries: option(
        int, "--retries", help="Tries again (after 1, 2, 4... s) when the Hub does not answer."
    ) = 3,
    json: JsonOpt = False,
) -> None:
    """Upload a stabilized checkpoint (weights, config, tokenizer, bema.json, model card) to the Hub.

    Uses huggingface_hub (HfApi.create_repo, HfApi.create_commit) with the token from HF_TOKEN or `hf auth login`; HF_ENDPOINT selects another Hub. Exit codes: 3 not a bema output, 6 no or refused token, 2 a bad --repo-id, 7 the name is another kind of repo (or the Hub refused it), 8 the Hub is unreachable, silent past --timeout after --retries, or failing.
    """
    from bema_cli.errors import UsageError
    from bema_cli.publish.push import push as run

    if not timeout > 0 or retries < 0:
        raise UsageError(f"--timeout must be > 0 and --retries >= 0, got {timeout} and {retries}")
    doc = run(
        Path(folder),
        repo_id,
        private,
        revision,
        commit_message,
        dry_run,
        timeout=timeout,
        retries=retries,
    )
    if json:
        output.print_json(doc)
        return
    if dry_run:
        for f in doc["files"]:
            output.stdout.print(f"{f['bytes']:>14,}  {f['path']}", highlight=False)
        output.stdout.print(
            f"would upload {len(doc['files'])} files, {doc['bytes'] / 1e6:.2f} MB, from {doc['folder']} "
            f"to {doc['repo_id']} ({doc['revision']})",
            highlight=False,
        )
        return
    output.stdout.print(f"pushed {doc['folder']} -> {doc['commit_url']}", highlight=False)

"""`bema push` against a local HTTP stand-in for the Hub (tests/hub_standin.py).

The Hub cannot be reached from here. The stand-in answers the endpoints huggingface_hub's client
calls (as read from its code); `bema push` runs unchanged, as a user runs it: the real `bema` CLI in
a subprocess, `HfApi` pointed at the stand-in by HF_ENDPOINT, the token from HF_TOKEN. Xet is off
(HF_HUB_DISABLE_XET=1): the stand-in speaks the LFS protocol only.
"""

from __future__ import annotations

import json
import shutil
import socket

import pytest
from conftest import one_line_error, run_bema
from hub_standin import TOKEN, HubStandIn, Repo
from trajectory import write_trajectory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    base, run = write_trajectory(root, [10, 20])
    out = root / "out"
    assert run_bema("stabilize", run, "--base", base, "--out", out, "--method", "bema").returncode == 0
    return out / "bema-k0.5-e0.2" / "checkpoint-20"


def hub_env(url: str, token: str | None = TOKEN) -> dict:
    env = {
        "HF_ENDPOINT": url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": "/nonexistent-bema-hf",
    }
    env["HF_TOKEN"] = token or ""
    return env


def test_push_uploads_every_file_in_one_commit(checkpoint):
    local = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    with HubStandIn() as hub:
        proc = run_bema(
            "push", checkpoint, "--repo-id", "org/bema-tiny", "--private", "--json", env=hub_env(hub.url)
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        repo = hub.repos["org/bema-tiny"]
        assert repo.kind == "model" and repo.private
        uploaded = repo.branches["main"]
        assert uploaded == local  # every byte, weights (LFS), bema.json and text (inline) alike
        assert {"README.md", "model.safetensors", "config.json", "bema.json"} <= set(local)
        # nothing of the machine: bema.json and the weights' header name the run's folders as the
        # card does (inside the folder the output shares with them), never an absolute local path
        record = json.loads(uploaded["bema.json"])
        assert record["source_checkpoint"] == "run/checkpoint-20" and record["theta0_source"] == "base"
        for name, data in uploaded.items():
            assert str(checkpoint.parents[2]).encode() not in data, name
        (commit,) = repo.commits
        assert commit["header"]["summary"] == "bema: bema-k0.5-e0.2 at checkpoint-20" == doc["commit_message"]
        sizes = sum(map(len, local.values()))
        assert doc["commit_oid"] == commit["oid"] and doc["bytes"] == sizes
        assert any(c.startswith("PUT /lfs-upload/") for c in hub.calls)  # the safetensors went by LFS
        # the revision it made, read back from the branch's head, in --json and in the local bema.json
        assert doc["revision_sha"] == commit["oid"]
        pushed = json.loads((checkpoint / "bema.json").read_text())["pushed"][-1]
        assert pushed == {"repo_id": "org/bema-tiny", "revision": "main", "revision_sha": commit["oid"],
                          "commit_url": doc["commit_url"]}  # fmt: skip
        local = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
        # a second push to a branch: the repo is kept, the branch made, a new commit lands there,
        # with bema.json as it is here
        proc = run_bema("push", checkpoint, "--repo-id", "org/bema-tiny", "--revision", "v2",
                        "--commit-message", "again", env=hub_env(hub.url))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        uploaded = repo.branches["v2"]
        assert json.loads(uploaded.pop("bema.json")) == json.loads(local.pop("bema.json"))
        assert uploaded == local and repo.commits[-1]["header"]["summary"] == "again"
        recorded = json.loads((checkpoint / "bema.json").read_text())["pushed"][-1]
        assert recorded["revision"] == "v2" and recorded["revision_sha"] == repo.commits[-1]["oid"]
        assert "pushed" in proc.stdout


def test_an_older_records_absolute_paths_are_shortened_as_uploaded(tmp_path):
    """bema.json of an older bema held absolute local paths: the uploaded copy names the folders as
    the card does; the local copy is left as it is."""
    from bema_cli.publish.push import published_record

    old = {"run": "ema-k0.5", "step": 40, "source_checkpoint": "/home/me/proj/run/checkpoint-40",
           "theta0_source": "/home/me/models/base", "coefficients": {"theta0": 0.5, "/home/me/proj/run/checkpoint-40": 0.5}}  # fmt: skip
    (tmp_path / "bema.json").write_text(json.dumps(old))
    sent = json.loads(published_record(tmp_path))
    assert sent["source_checkpoint"] == "run/checkpoint-40" and sent["theta0_source"] == "models/base"
    assert sent["coefficients"] == {"theta0": 0.5, "run/checkpoint-40": 0.5} and "/home/me" not in json.dumps(
        sent
    )
    assert json.loads((tmp_path / "bema.json").read_text()) == old


def test_dry_run_lists_files_and_contacts_nobody(checkpoint):
    with HubStandIn() as hub:
        proc = run_bema(
            "push", checkpoint, "--repo-id", "org/x", "--dry-run", "--json", env=hub_env(hub.url, None)
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        sizes = {f["path"]: f["bytes"] for f in doc["files"]}
        local = {p.name: p.stat().st_size for p in checkpoint.iterdir() if p.is_file()}
        assert sizes == local  # as it is here
        assert hub.calls == [] and not hub.repos
        plain = run_bema(
            "push", checkpoint.parent.parent, "--repo-id", "org/x", "--dry-run", env=hub_env(hub.url)
        )
        assert plain.returncode == 3  # an OUT with several checkpoints is not one thing to push
        text = run_bema("push", checkpoint, "--repo-id", "org/x", "--dry-run", env=hub_env(hub.url)).stdout
        assert "model.safetensors" in text and "would upload" in text


def test_failures_are_one_line_with_distinct_exit_codes(checkpoint, tmp_path):
    not_bema = tmp_path / "plain"
    not_bema.mkdir()
    (not_bema / "model.safetensors").write_bytes(b"x")
    with HubStandIn() as hub:
        hub.repos["org/data"] = Repo("dataset")
        cases = [
            ((not_bema, "--repo-id", "org/m"), hub_env(hub.url), 3, "not a bema output"),
            ((checkpoint, "--repo-id", "org/m"), hub_env(hub.url, None), 6, "no Hugging Face token"),
            ((checkpoint, "--repo-id", "org/m"), hub_env(hub.url, "hf_wrong"), 6, "refused the token"),
            ((checkpoint, "--repo-id", "org/data"), hub_env(hub.url), 7, "a dataset repo"),
        ]
        for args, env, code, needle in cases:
            line = one_line_error(run_bema("push", *args, env=env), code)
            assert needle in line, line
        assert "org/m" not in hub.repos
    with socket.socket() as s:  # a port nobody listens on: the network failure
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = one_line_error(
        run_bema(
            "push",
            checkpoint,
            "--repo-id",
            "org/m",
            "--retries",
            "0",
            env=hub_env(f"http://127.0.0.1:{port}"),
        ),
        8,
    )
    assert "unreachable" in line


FAST = ["--timeout", "1", "--retries", "1"]


@pytest.mark.parametrize(
    "fault, where",
    [
        (("hang", "GET /api/models/"), "repo info"),  # accepts the connection, never answers
        (("hang", "POST /api/models/org/m/commit/"), "upload"),
        # the large file: the client's own 5 retries with backoff, then one of bema's (~1 min)
        pytest.param(("hang", "PUT /lfs-upload/"), "upload", marks=pytest.mark.slow),
        (("text", "GET /api/models/"), "repo info"),  # a 200 that is not JSON
        (("status", "PUT /lfs-upload/", 500), "upload"),  # the large file's upload fails
    ],
    ids=["hang-info", "hang-commit", "hang-lfs", "not-json", "lfs-500"],
)
def test_a_hub_that_hangs_or_fails_is_one_line_exit_8(checkpoint, fault, where):
    """A Hub that never answers ends in bounded time (--timeout per answer, --retries with backoff)."""
    with HubStandIn() as hub:
        hub.fault = fault
        proc = run_bema("push", checkpoint, "--repo-id", "org/m", *FAST, env=hub_env(hub.url), timeout=180)
        line = one_line_error(proc, 8)
        assert f"the Hub at {hub.url}" in line and f"({where}:" in line, line
        if fault[0] == "hang":
            assert sum(c.startswith(fault[1]) for c in hub.calls) >= 2  # tried again before giving up


def test_the_whole_push_is_bounded_by_timeout_and_retries(checkpoint):
    """A Hub that stops answering mid-upload (the large file's PUT): the client's own retries run
    inside bema's, yet the push ends within its stated bound, (retries + 1) x timeout + bema's
    backoffs + the client's last backoff (docs/usage.md); it took 1545 s with the defaults before."""
    import time

    from bema_cli.publish.push import CLIENT_BACKOFF, budget

    with HubStandIn() as hub:
        hub.fault = ("hang", "PUT /lfs-upload/")
        t = time.monotonic()
        proc = run_bema("push", checkpoint, "--repo-id", "org/m", "--timeout", "2", "--retries", "1",
                        env=hub_env(hub.url), timeout=300)  # fmt: skip
        took = time.monotonic() - t
    line = one_line_error(proc, 8)
    assert "(upload:" in line, line
    assert took <= budget(2, 1) + CLIENT_BACKOFF + 10, took  # 10 s: the interpreter's start and the hashing
    assert budget(60, 3) == 247


def test_a_bad_repo_id_is_a_usage_error_before_any_request(checkpoint):
    with HubStandIn() as hub:
        for bad in ("org/m?x=1", "org/m m", "org/-m-", "justname"):
            line = one_line_error(run_bema("push", checkpoint, "--repo-id", bad, env=hub_env(hub.url)), 2)
            assert "--repo-id" in line and repr(bad) in line, line
        assert hub.calls == []


def test_a_symbolic_link_in_the_folder_is_refused_before_anything_is_sent(checkpoint, tmp_path):
    folder = tmp_path / "linked"
    shutil.copytree(checkpoint, folder)
    secret = tmp_path / "outside.json"
    secret.write_text('{"secret": 1}')
    (folder / "tokenizer.json").unlink(missing_ok=True)
    (folder / "tokenizer.json").symlink_to(secret)
    with HubStandIn() as hub:
        for extra in ([], ["--dry-run"]):
            line = one_line_error(
                run_bema("push", folder, "--repo-id", "org/m", *extra, env=hub_env(hub.url)), 3
            )
            assert f"{folder / 'tokenizer.json'}: a symbolic link" in line, line
        assert hub.calls == [] and not hub.repos


@pytest.mark.parametrize("content", [b"[]", b"{bad", b"\0\0\0"])
def test_a_bema_json_that_is_not_a_record_is_one_line_exit_3(checkpoint, tmp_path, content):
    folder = tmp_path / "m"
    shutil.copytree(checkpoint, folder)
    (folder / "bema.json").write_bytes(content)
    line = one_line_error(run_bema("push", folder, "--repo-id", "org/m", "--dry-run"), 3)
    assert f"{folder / 'bema.json'}:" in line, line

"""A local HTTP stand-in for the Hugging Face Hub, for `bema push` tests.

The Hub cannot be reached from the test machines, so this server answers the endpoints that
huggingface_hub 2.x's `HfApi.repo_exists`, `create_repo`, `create_branch` and `upload_folder`
call, as read from the client's code (hf_api.py, _commit_api.py, lfs.py): repo info, repo
creation, branch creation, the model card's metadata check (validate-yaml), the preupload check,
the LFS batch API with a basic (single PUT) transfer, and the NDJSON commit. It keeps what a commit adds in memory (`repos`), so a test can
compare the uploaded bytes with the folder. It is not the Hub: it checks only the bearer token,
and it speaks LFS, not Xet, so the tests set HF_HUB_DISABLE_XET=1 (with hf_xet installed the
client would otherwise upload through the Xet protocol, which this stand-in does not implement).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import yaml

TOKEN = "hf_standin_token"


@dataclass
class Repo:
    kind: str  # model | dataset | space
    private: bool = False
    branches: dict = field(default_factory=lambda: {"main": {}})  # branch -> {path: bytes}
    commits: list = field(default_factory=list)


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # oid -> bytes uploaded by PUT
        self.calls: list[str] = []  # "METHOD path" of every request, in order
        # a fault for requests whose "METHOD path" starts with `prefix`: ("hang", prefix) accepts and
        # never answers (until the stand-in stops), ("status", prefix, code) answers that status,
        # ("text", prefix) answers 200 with a body that is not JSON
        self.fault: tuple | None = None
        self.released = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()  # hung handlers end
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: dict | None = None, headers: dict | None = None):
                data = json.dumps(body or {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _faulty(self, method: str) -> bool:
                """Apply `hub.fault` to this request; True when it was answered (or left hanging)."""
                fault = hub.fault
                if fault is None or not f"{method} {self.path}".startswith(fault[1]):
                    return False
                if fault[0] == "hang":
                    hub.released.wait(120)  # bounded: the stand-in stops, or two minutes pass
                    self.close_connection = True
                elif fault[0] == "status":
                    self._body()
                    self._send(fault[2], {"error": f"stand-in fault {fault[2]}"})
                else:
                    data = b"<html>not json</html>"
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                return True

            def _authorized(self) -> bool:
                if self.headers.get("authorization") == f"Bearer {TOKEN}":
                    return True
                self._send(401, {"error": "Invalid credentials in Authorization header"})
                return False

            def do_GET(self):
                hub.calls.append(f"GET {self.path}")
                if self._faulty("GET"):
                    return
                if self.path == "/api/whoami-v2":  # whose token: the one token the stand-in knows
                    if self._authorized():
                        self._send(200, {"type": "user", "name": "stand-in-user"})
                    return
                m = re.fullmatch(
                    r"/api/(models|datasets|spaces)/([^/]+/[^/?]+)(?:/revision/([^?]+))?(\?.*)?", self.path
                )
                if m:
                    repo = hub.repos.get(m.group(2))
                    if repo is None or repo.kind + "s" != m.group(1):
                        return self._send(
                            404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
                        )
                    files = repo.branches["main"]
                    branch = unquote(m.group(3) or "main")  # the branch head: its last commit's oid
                    sha = next((c["oid"] for c in reversed(repo.commits) if c["branch"] == branch), "0" * 40)
                    return self._send(200, {"id": m.group(2), "private": repo.private, "sha": sha,
                                            "siblings": [{"rfilename": f} for f in files]})  # fmt: skip
                self._send(404, {"error": f"no route {self.path}"})

            def do_PUT(self):
                hub.calls.append(f"PUT {self.path}")
                if self._faulty("PUT"):
                    return
                m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", self.path)
                data = self._body()
                if not m or hashlib.sha256(data).hexdigest() != m.group(1):
                    return self._send(400, {"error": "bad LFS upload"})
                hub.lfs[m.group(1)] = data
                self._send(200, {})

            def do_POST(self):
                hub.calls.append(f"POST {self.path}")
                if self._faulty("POST"):
                    return
                path = self.path.split("?")[0]
                body = self._body()
                if path == "/api/validate-yaml":  # the client checks README.md's metadata before a commit
                    content = json.loads(body)["content"]
                    m = re.match(r"^---\n(.*?)\n---\n", content, re.S)
                    meta = yaml.safe_load(m.group(1)) if m else None
                    base = (meta or {}).get("base_model")
                    if not isinstance(meta, dict) or (
                        base is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", base)
                    ):
                        return self._send(400, {"error": "Invalid metadata in README.md"})
                    return self._send(200, {"warnings": []})
                if path == "/api/repos/create":
                    if not self._authorized():
                        return
                    req = json.loads(body)
                    repo_id = f"{req['organization']}/{req['name']}"
                    if repo_id in hub.repos:
                        return self._send(
                            409,
                            {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"},
                        )
                    hub.repos[repo_id] = Repo(req.get("type") or "model", req.get("visibility") == "private")
                    return self._send(200, {"url": f"{hub.url}/{repo_id}"})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/(.+)", path)
                if m:
                    if not self._authorized():
                        return
                    repo = hub.repos[m.group(1)]
                    if m.group(2) in repo.branches:
                        return self._send(409, {"error": "Reference already exists"})
                    repo.branches[m.group(2)] = dict(repo.branches["main"])
                    return self._send(200, {})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/(.+)", path)
                if m:
                    if not self._authorized():
                        return
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [
                        {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                         "shouldIgnore": False, "oid": None} for f in files]})  # fmt: skip
                m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
                if m:
                    if not self._authorized():
                        return
                    req = json.loads(body)
                    objects = [{"oid": o["oid"], "size": o["size"], "authenticated": True,
                                "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}}
                               for o in req["objects"]]  # fmt: skip
                    return self._send(200, {"transfer": "basic", "objects": objects})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/(.+)", path)
                if m:
                    if not self._authorized():
                        return
                    repo, branch = hub.repos[m.group(1)], m.group(2)
                    tree = repo.branches.setdefault(branch, {})
                    header = None
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        value = item["value"]
                        if item["key"] == "header":
                            header = value
                        elif item["key"] == "file":
                            tree[value["path"]] = base64.b64decode(value["content"])
                        elif item["key"] == "lfsFile":
                            if value["oid"] not in hub.lfs:
                                return self._send(
                                    400, {"error": f"LFS object {value['oid']} was never uploaded"}
                                )
                            tree[value["path"]] = hub.lfs[value["oid"]]
                    oid = hashlib.sha1(body).hexdigest()
                    repo.commits.append({"header": header, "branch": branch, "oid": oid})
                    return self._send(
                        200, {"commitUrl": f"{hub.url}/{m.group(1)}/commit/{oid}", "commitOid": oid}
                    )
                self._send(404, {"error": f"no route {path}"})

        return Handler

"""A model hub on this machine: the Hugging Face hub's file protocol for model folders on disk.

No hub can be reached from here, so the devcluster (and the tests) run this instead, and pods
download from it exactly as they would from huggingface.co or a private mirror
(`HF_ENDPOINT`): `huggingface_hub.snapshot_download` asks it for a revision's commit
(`/api/models/<repo>/revision/<rev>`), the file tree (`/api/models/<repo>/tree/<commit>`) and
each file (`HEAD`/`GET /<repo>/resolve/<commit>/<path>`, with the commit, ETag and size
headers the hub sends). Revisions are branches or tags pointing at commits; a commit is a
folder. With `--token`, requests without `Authorization: Bearer <token>` get 401, as a private
repository does.

Standard library only: it runs in the devcluster's base image as a pod, and on this machine.

    python -m warmgate_devcluster.hubmirror --root DIR [--port 8000] [--token T]

Layout of DIR (`seed` writes it): `<org>/<name>/refs.json` ({"main": "<commit>", ...}) and
`<org>/<name>/commits/<commit>/<files>`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

# Files the hub stores in LFS (their ETag is the content's sha256).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".onnx", ".h5", ".msgpack")
CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    blob_id: str  # git's blob sha1
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id

    def tree_json(self) -> dict:
        item = {"type": "file", "path": self.path, "size": self.size, "oid": self.blob_id}
        if self.sha256:
            item["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 134}
        return item


def _index(folder: Path) -> dict[str, Entry]:
    entries = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = file.relative_to(folder).as_posix()
        hidden = any(part.startswith(".") for part in relative.split("/"))
        if hidden and relative != ".gitattributes":
            continue  # markers and editors' files, never part of a published model
        blob = hashlib.sha1(f"blob {file.stat().st_size}\0".encode())
        content = hashlib.sha256()
        with file.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                blob.update(chunk)
                content.update(chunk)
        lfs = relative.endswith(LFS_SUFFIXES)
        entries[relative] = Entry(
            relative, file.stat().st_size, blob.hexdigest(), content.hexdigest() if lfs else None
        )
    return entries


def commit_of(folder: Path) -> str:
    """A stable 40-hex commit id for a folder's content (names and content hashes)."""
    digest = hashlib.sha1()
    for entry in _index(folder).values():
        digest.update(f"{entry.path}\0{entry.blob_id}\n".encode())
    return digest.hexdigest()


def seed(root: Path, repo_id: str, revision: str, folder: Path) -> str:
    """Publish `folder` as `revision` (a branch or tag) of `repo_id`; returns its commit."""
    repo = root / repo_id
    commit = commit_of(folder)
    target = repo / "commits" / commit
    if not target.is_dir():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(
            folder, partial, symlinks=False, ignore=shutil.ignore_patterns(".complete", ".readable")
        )
        partial.rename(target)
    set_ref(root, repo_id, revision, commit)
    return commit


def set_ref(root: Path, repo_id: str, revision: str, commit: str | None) -> None:
    """Point a branch or tag at a published commit (None: delete it), as a push does. Several
    processes may share a root: the read-modify-write holds a lock."""
    repo = root / repo_id
    repo.mkdir(parents=True, exist_ok=True)
    with open(repo / "refs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        refs_file = repo / "refs.json"
        refs = json.loads(refs_file.read_text()) if refs_file.is_file() else {}
        if commit is None:
            refs.pop(revision, None)
        else:
            if not (repo / "commits" / commit).is_dir():
                raise ValueError(f"{repo_id} has no commit {commit}")
            refs[revision] = commit
        partial = refs_file.with_suffix(".partial")
        partial.write_text(json.dumps(refs, indent=2, sort_keys=True))
        partial.replace(refs_file)


class Hub:
    """The repositories under a root, their refs and file indexes (computed once per commit)."""

    def __init__(self, root: Path, token: str | None = None, rate: float | None = None) -> None:
        self.root = root
        self.token = token
        self.rate = rate
        """Bytes per second per file transfer (None: as fast as it goes), to watch progress."""
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request answered, in order."""
        self._indexes: dict[tuple[str, str], dict[str, Entry]] = {}
        self._lock = threading.Lock()

    def resolve(self, repo_id: str, revision: str) -> str | None:
        repo = self.root / repo_id
        if (repo / "commits" / revision).is_dir():
            return revision
        refs_file = repo / "refs.json"
        if not refs_file.is_file():
            return None
        return json.loads(refs_file.read_text()).get(revision)

    def exists(self, repo_id: str) -> bool:
        return (self.root / repo_id / "refs.json").is_file()

    def index(self, repo_id: str, commit: str) -> dict[str, Entry]:
        with self._lock:
            key = (repo_id, commit)
            if key not in self._indexes:
                self._indexes[key] = _index(self.root / repo_id / "commits" / commit)
            return self._indexes[key]

    def file(self, repo_id: str, commit: str, path: str) -> Path:
        return self.root / repo_id / "commits" / commit / path


def _split_repo(parts: list[str]) -> tuple[str, list[str]] | None:
    """`org/name/rest...` (repository ids have exactly one slash here)."""
    if len(parts) < 2:
        return None
    return f"{parts[0]}/{parts[1]}", parts[2:]


def make_handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

        def _send_json(self, status: int, body: object, headers: dict | None = None) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _error(self, status: int, code: str, message: str) -> None:
            self._send_json(status, {"error": message}, {"X-Error-Code": code})

        def _authorized(self) -> bool:
            if hub.token is None:
                return True
            if self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self._error(401, "RepoNotFound", "Invalid credentials in Authorization header")
            return False

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            hub.requests.append((self.command, self.path))
            if not self._authorized():
                return
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/") if p]
            if parts[:2] == ["api", "models"]:
                split = _split_repo(parts[2:])
                if split is None:
                    return self._error(404, "EntryNotFound", "not found")
                repo_id, rest = split
                if not hub.exists(repo_id):
                    return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                if rest[:1] == ["revision"] and len(rest) == 2:
                    return self._revision(repo_id, rest[1])
                if rest[:1] == ["tree"] and len(rest) >= 2:
                    return self._tree(repo_id, rest[1], "/".join(rest[2:]))
                return self._error(404, "EntryNotFound", "not found")
            split = _split_repo(parts)
            if split is not None and split[1][:1] == ["resolve"] and len(split[1]) >= 3:
                repo_id, rest = split
                return self._resolve(repo_id, rest[1], "/".join(rest[2:]))
            return self._error(404, "EntryNotFound", "not found")

        def _commit(self, repo_id: str, revision: str) -> str | None:
            commit = hub.resolve(repo_id, revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return commit

        def _revision(self, repo_id: str, revision: str) -> None:
            commit = self._commit(repo_id, revision)
            if commit is None:
                return
            siblings = [{"rfilename": path} for path in hub.index(repo_id, commit)]
            self._send_json(
                200,
                {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": commit,
                    "private": False,
                    "siblings": siblings,
                    "tags": [],
                },
            )

        def _tree(self, repo_id: str, revision: str, prefix: str) -> None:
            commit = self._commit(repo_id, revision)
            if commit is None:
                return
            entries = [
                entry.tree_json()
                for path, entry in hub.index(repo_id, commit).items()
                if not prefix or path.startswith(prefix.rstrip("/") + "/")
            ]
            self._send_json(200, entries)

        def _resolve(self, repo_id: str, revision: str, path: str) -> None:
            if not hub.exists(repo_id):
                return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            commit = self._commit(repo_id, revision)
            if commit is None:
                return
            entry = hub.index(repo_id, commit).get(path)
            if entry is None:
                return self._error(404, "EntryNotFound", f"{path} does not exist at {commit}")
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(entry.size))
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{entry.blob_id}"')
            if entry.sha256:
                self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
                self.send_header("X-Linked-Size", str(entry.size))
            self.end_headers()
            if self.command == "HEAD":
                return
            with hub.file(repo_id, commit, path).open("rb") as handle:
                if hub.rate is None:
                    shutil.copyfileobj(handle, self.wfile, CHUNK)
                    return
                started, sent = time.monotonic(), 0
                while chunk := handle.read(CHUNK // 16):
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    ahead = sent / hub.rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)

    return Handler


def serve(
    root: Path, host: str, port: int, token: str | None = None, rate: float | None = None
) -> ThreadingHTTPServer:
    """A started server (in a thread of its own); `.server_address` has the port and
    `.hub` the Hub (its request log)."""
    hub = Hub(root, token, rate)
    server = ThreadingHTTPServer((host, port), make_handler(hub))
    server.hub = hub  # type: ignore[attr-defined]
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmgate_devcluster.hubmirror")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token", default=os.environ.get("HUB_TOKEN") or None)
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(Hub(args.root, args.token)))
    print(f"hub mirror of {args.root} on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

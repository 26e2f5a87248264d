"""A stand-in for the Hugging Face hub over HTTP (HF_ENDPOINT=hub.url): one model repo served from a local folder,
as huggingface_hub's snapshot_download and transformers' from_pretrained ask for it (repo info, file tree, HEAD and
GET of each file); gated: every request refused as the hub refuses a gated repo without a token. Its files can be
sent at a set rate (bytes_per_s), and each request is logged with its start and end times."""

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeHub:
    def __init__(self, folder: Path, repo: str, gated: bool = False, bytes_per_s: float | None = None):
        self.repo, self.gated, self.rate, self.requests = repo, gated, bytes_per_s, []  # (method, path, start, end)
        paths = sorted(p for p in folder.rglob("*") if p.is_file())
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in paths}
        self.sha = hashlib.sha1("".join(self.files).encode()).hexdigest()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.answer(self, send_body=True)

            def do_HEAD(self):
                hub.answer(self, send_body=False)

        return Handler

    def answer(self, request, send_body: bool) -> None:
        start, path = time.monotonic(), request.path.split("?")[0]
        api, resolve = f"/api/models/{self.repo}", f"/{self.repo}/resolve/"
        status, body, headers = 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": self.sha}
        if self.gated:
            status, headers = 401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is restricted"}
        elif path.startswith(f"{api}/tree/") and path.count("/") == 6:  # the whole tree (a folder's: none)
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in self.files.items()]  # fmt: skip
            status, body = 200, json.dumps(tree).encode()
        elif path in (api, f"{api}/revision/main", f"{api}/revision/{self.sha}"):
            info = {"id": self.repo, "sha": self.sha, "siblings": [{"rfilename": name} for name in self.files]}
            status, body = 200, json.dumps(info).encode()
        elif path.startswith(resolve) and (name := path[len(resolve) :].partition("/")[2]) in self.files:
            body = self.files[name]
            status, headers = 200, {"X-Repo-Commit": self.sha, "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            request.send_header(key, value)
        request.end_headers()
        step = max(1, int(self.rate / 20)) if self.rate and status == 200 and path.startswith(resolve) else None
        for i in range(0, len(body) if send_body else 0, step or max(1, len(body))):
            request.wfile.write(body[i : i + (step or len(body))])
            if step:
                time.sleep(step / self.rate)
        self.requests.append((request.command, path, start, time.monotonic()))

    def close(self) -> None:
        self.server.shutdown()

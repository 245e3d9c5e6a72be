"""shardwire serve as a real process, and raw HTTP calls to it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

KEY = "test-key"


CTX = 256


PARALLEL = 4


class ServeProcess:
    def __init__(self, model, workers, cache_dir, *flags: str):
        cmd = [
            sys.executable,
            "-m",
            "shardwire",
            "--log-level",
            "info",
            "serve",
            str(model),
            *(("--rpc", ",".join(w.address for w in workers)) if workers else ()),  # none: in this process
            "--port",
            "0",
            "-c",
            str(CTX),
            "-np",
            str(PARALLEL),
            "--api-key",
            KEY,
            "--cache-dir",
            str(cache_dir),
            "--threads",
            "1",
            "--dtype",
            "float32",
            "--metrics",
            *flags,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            if m := re.search(r"listening on (http://\S+)", line):
                self.url = m[1]
                break
        else:
            raise RuntimeError("serve did not start:\n" + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while call(self.url, "/health")[0] != 200:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("serve never became healthy:\n" + "".join(self.log))
            time.sleep(0.1)

    def stop(self) -> int:
        self.proc.send_signal(2)  # Ctrl-C
        return self.proc.wait(20)


def call(url: str, path: str, body: bytes | dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    """A raw HTTP request, for what the openai client will not send (invalid JSON, wrong keys)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}

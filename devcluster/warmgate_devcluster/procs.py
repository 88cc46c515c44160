"""Background processes recorded by pid and start time, stopped by pid (never by name).

Each process starts in its own session, so its process group id is its pid and stopping it
also stops the children it forked. The start time (from /proc) guards against a recycled pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcRecord:
    name: str
    pid: int
    start_ticks: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ProcRecord:
        return cls(str(data["name"]), int(data["pid"]), int(data["start_ticks"]))


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses; the fields after the last ')' do not.
    return raw[raw.rfind(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of stat, counted after "pid (comm)"


def pid_running(pid: int, ticks: int | None = None) -> bool:
    """True when the pid exists, is not a zombie and (if given) started at `ticks`."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return False
    return ticks is None or int(fields[19]) == ticks


def is_running(record: ProcRecord) -> bool:
    return pid_running(record.pid, record.start_ticks)


def spawn(
    name: str,
    argv: list[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[ProcRecord, subprocess.Popen]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    ticks = start_ticks(proc.pid)
    return ProcRecord(name, proc.pid, ticks if ticks is not None else -1), proc


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _reap(pid: int) -> None:
    # Only our own children can be reaped; others are reaped by their parent (or init).
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop(record: ProcRecord, grace: float = 10.0) -> bool:
    """SIGTERM the process group, wait up to `grace`, then SIGKILL. True if it had been running."""
    if not is_running(record):
        _reap(record.pid)
        return False
    _signal_group(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(record.pid)
        if not is_running(record):
            break
        time.sleep(0.05)
    else:
        _signal_group(record.pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + 5
        while time.monotonic() < kill_deadline and is_running(record):
            _reap(record.pid)
            time.sleep(0.05)
    # Children that outlived their leader still carry its group id.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(record.pid, signal.SIGKILL)
    _reap(record.pid)
    return True


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 right now (all held open together, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()

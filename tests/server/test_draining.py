"""Draining is safe for pooled keep-alive clients: after SIGTERM every response says
`Connection: close`, an idle keep-alive connection is closed by the server, the requests in
flight finish, and the process exits once no connection is left (a real server process, the
OpenAI SDK's pooled client with retries off, and a raw keep-alive socket)."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import openai

from warmgate_testkit.process import ServerProcess

ARGS = [
    "--device", "cpu", "--sequence-buckets", "16,32", "--warmup-batch-sizes", "1,4",
    "--max-batch-size", "4", "--drain-seconds", "30",
]  # fmt: skip


def test_sigterm_closes_keep_alive_connections_without_losing_a_request(minilm_dir: Path) -> None:
    with ServerProcess(["--model", str(minilm_dir), *ARGS]) as server:
        server.wait_ready(300)
        address = urlsplit(server.url)
        idle = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        idle.request("GET", "/healthz")
        first = idle.getresponse()
        first.read()
        assert first.status == 200 and first.getheader("Connection") != "close"

        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        outcomes: list[tuple[str, str | None]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def send() -> None:
            """One client thread of a pooled SDK: it keeps sending until told to stop or
            until a response tells it the connection closes."""
            while not stop.is_set():
                try:
                    raw = sdk.embeddings.with_raw_response.create(
                        model=minilm_dir.name,
                        input=["drain me gently"] * 3,
                    )
                    raw.parse()
                    outcomes.append(("ok", raw.headers.get("connection")))
                    if raw.headers.get("connection") == "close":
                        return
                except BaseException as error:
                    errors.append(error)
                    return

        senders = [threading.Thread(target=send) for _ in range(3)]
        for thread in senders:
            thread.start()
        until = time.monotonic() + 30
        while len(outcomes) < 15 and not errors and time.monotonic() < until:
            time.sleep(0.01)
        signalled = time.monotonic()
        server.terminate()
        for thread in senders:
            thread.join(30)
        stop.set()
        sdk.close()

        assert not errors, errors
        assert len(outcomes) >= 15
        closes = [header for status, header in outcomes if header == "close"]
        assert len(closes) == len(senders), outcomes[-6:]  # each thread was told, and left
        # The idle keep-alive connection is closed by the server (EOF), not left to fail the
        # client's next request when the process is gone.
        assert idle.sock is not None
        idle.sock.settimeout(10)
        assert idle.sock.recv(1) == b""
        assert time.monotonic() - signalled < 10
        idle.close()
        assert server.wait(timeout=30) == 0
        assert "drained cleanly" in server.log()


def test_a_standby_server_sends_its_keep_alive_clients_away_and_still_serves(
    minilm_dir: Path,
) -> None:
    """POST /role standby (the operator demoting a pod out of the Service): every response
    closes its connection, an idle keep-alive connection is closed by the server, requests
    that still come are served, /ready stays 200; serving again keeps connections."""
    with ServerProcess(["--model", str(minilm_dir), *ARGS]) as server:
        server.wait_ready(300)
        address = urlsplit(server.url)
        idle = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        idle.request("GET", "/healthz")
        idle.getresponse().read()
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        before = sdk.embeddings.with_raw_response.create(model=minilm_dir.name, input=["a"])
        assert before.headers.get("connection") != "close"

        control = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        control.request("POST", "/role", body=b'{"role": "standby"}')
        answer = control.getresponse()
        assert (answer.status, answer.read()) == (200, b'{"role": "standby"}')
        control.close()

        # The SDK's pooled connection: served, and told to reconnect.
        during = sdk.embeddings.with_raw_response.create(model=minilm_dir.name, input=["b"])
        assert len(during.parse().data[0].embedding) == 384
        assert during.headers.get("connection") == "close"
        assert idle.sock is not None
        idle.sock.settimeout(10)
        assert idle.sock.recv(1) == b""  # closed by the server once idle
        idle.close()
        ready = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        ready.request("GET", "/ready")
        assert ready.getresponse().status == 200
        ready.close()

        bad = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        bad.request("POST", "/role", body=b'{"role": "spare"}')
        refused = bad.getresponse()
        assert refused.status == 422
        assert "serving" in refused.read().decode()
        bad.close()

        control = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        control.request("POST", "/role", body=b'{"role": "serving"}')
        assert control.getresponse().read() == b'{"role": "serving"}'
        control.close()
        after = [
            sdk.embeddings.with_raw_response.create(model=minilm_dir.name, input=["c"])
            for _ in range(2)
        ]
        assert after[-1].headers.get("connection") != "close"  # kept alive again
        sdk.close()

"""Slow and idle clients against a running ``jitckpt webhook serve``, over real TLS.

Under ``failurePolicy: Fail`` a webhook that waits on slow clients blocks pod
creation for everyone. Each attacker here speaks raw TLS: one connects and
sends nothing, one trickles its headers a byte at a time, and as many as the
server takes at once trickle a body. While they hold every slot, an admission
waits its short turn (``QUEUE_SECONDS``) and is answered 503; the server then
cuts each of them off, long before it has sent what it announced, and admits
again.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.webhook.server_support import admission_review, check_answer, fixture, jitckpt, serve
from webhook.server import MAX_IN_FLIGHT

HOST = "127.0.0.1"
TRICKLE_SECONDS = 0.5
TRICKLE_BYTES = 60  # 30 s of trickling: far beyond every deadline of the server


@dataclass
class SlowClient:
    """A raw TLS client that sends ``head`` then trickles ``tail`` a byte at a time."""

    url: str
    context: ssl.SSLContext
    head: bytes
    tail: bytes
    sent: int = 0  # bytes of ``tail`` sent before the server closed
    answer: bytes = b""
    closed_by_server: bool = False
    error: str = ""
    thread: threading.Thread = field(init=False)

    def start(self) -> SlowClient:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        host, port = self.url.removeprefix("https://").split(":")
        try:
            with (
                socket.create_connection((host, int(port)), timeout=60) as raw,
                self.context.wrap_socket(raw, server_hostname=host) as tls,
            ):
                tls.sendall(self.head)
                tls.settimeout(TRICKLE_SECONDS)
                for byte in self.tail:
                    if self._read(tls):
                        return
                    tls.sendall(bytes([byte]))
                    self.sent += 1
                tls.settimeout(5)
                while not self._read(tls):
                    pass
        except OSError as exc:  # a reset while writing: the server closed
            self.closed_by_server = True
            self.error = repr(exc)

    def _read(self, tls: ssl.SSLSocket) -> bool:
        """Read what the server sent; True once it closed the connection."""
        try:
            data = tls.recv(65536)
        except TimeoutError:
            return False
        if not data:
            self.closed_by_server = True
            return True
        self.answer += data
        return False


def test_slow_clients_are_cut_off_and_never_make_admissions_wait(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    jitckpt("webhook", "certs", "--out", str(certs), "--dns", HOST)
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    body = json.dumps(admission_review(fixture("pytorchjob-master.yaml"))).encode()
    slow_body_head = (
        b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with serve(certs, tmp_path) as server:
        clients = (
            [
                SlowClient(server.url, context, b"", b""),  # connects, sends nothing
                SlowClient(server.url, context, b"POST /mutate HTTP/1.1\r\n", b"X" * TRICKLE_BYTES),
            ]
            + [
                SlowClient(server.url, context, slow_body_head, body[:TRICKLE_BYTES])
                for _ in range(MAX_IN_FLIGHT)
            ]
        )
        for client in clients:
            client.start()
        with httpx.Client(base_url=server.url, verify=context, timeout=10) as http:
            # Every admission slot is held by a slow body: 503 after a short wait.
            deadline = time.monotonic() + 10
            while True:
                busy = http.post(
                    "/mutate", json=admission_review(fixture("pytorchjob-master.yaml"))
                )
                if busy.status_code == 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert busy.status_code == 503, busy.text
            check_answer(busy.json(), None)
            assert "in flight" in busy.json()["response"]["status"]["message"]
            assert http.get("/healthz").status_code == 200  # probes are never starved

            for client in clients:
                client.thread.join(timeout=60)
                assert not client.thread.is_alive()

            # Once they are gone, admissions are served again.
            review = admission_review(fixture("pytorchjob-master.yaml"))
            ok = http.post("/mutate", json=review)
            assert ok.status_code == 200
            check_answer(ok.json(), review["request"]["uid"])
            metrics = http.get("/metrics").text

    idle, slow_headers, *slow_bodies = clients
    for client in clients:
        assert client.closed_by_server, client
    assert idle.answer == b""
    assert slow_headers.sent < TRICKLE_BYTES and slow_headers.answer == b""
    for client in slow_bodies:
        # Answered 408 with a well-formed review, and cut off mid-body.
        assert client.sent < len(client.tail), client
        status, _, rest = client.answer.partition(b"\r\n")
        assert status == b"HTTP/1.1 408 Request Timeout", client.answer[:200]
        check_answer(json.loads(rest.partition(b"\r\n\r\n")[2]), None)
    assert f'jitckpt_webhook_failed_total{{reason="timeout"}} {MAX_IN_FLIGHT}.0' in metrics
    assert 'jitckpt_webhook_failed_total{reason="busy"}' in metrics


def test_a_burst_beyond_the_slots_waits_its_turn_instead_of_503(tmp_path: Path) -> None:
    """Every slot held by a client that completes its body within a second (a burst of
    pod creations, not an attack): the next admission waits for a slot and is served."""
    certs = tmp_path / "certs"
    jitckpt("webhook", "certs", "--out", str(certs), "--dns", HOST)
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    review = admission_review(fixture("pytorchjob-master.yaml"))
    body = json.dumps(review).encode()
    head = (
        b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    answers: list[bytes] = []

    def paused(url: str) -> None:
        host, port = url.removeprefix("https://").split(":")
        with (
            socket.create_connection((host, int(port)), timeout=30) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            tls.sendall(head + body[:-10])
            time.sleep(1.0)  # holds its slot, well within BODY_READ_SECONDS
            tls.sendall(body[-10:])
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
            answers.append(answer)

    with serve(certs, tmp_path) as server:
        holders = [
            threading.Thread(target=paused, args=(server.url,), daemon=True)
            for _ in range(MAX_IN_FLIGHT)
        ]
        for thread in holders:
            thread.start()
        time.sleep(0.3)  # every slot is held now
        with httpx.Client(base_url=server.url, verify=context, timeout=10) as http:
            waited = http.post("/mutate", json=review)
        for thread in holders:
            thread.join(timeout=30)
    assert waited.status_code == 200, waited.text
    check_answer(waited.json(), review["request"]["uid"])
    assert waited.json()["response"]["allowed"] is True  # reviewed, not refused as busy
    assert len(answers) == MAX_IN_FLIGHT
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers)

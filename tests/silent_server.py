"""A local HTTP endpoint that accepts connections and never answers: a tracking server or a hub that hangs.

It listens on 127.0.0.1 only, and holds each request at most `hold_s` seconds (then closes it), so a test that
goes wrong still ends. `health=True` answers `GET .../health` (a probe) and holds everything else;
`status=404` answers everything else with that status at once instead of holding it.
"""

from __future__ import annotations

import socket
import threading

HOLD_S = 60.0


class SilentServer:
    def __init__(self, health: bool = False, status: int | None = None, hold_s: float = HOLD_S) -> None:
        self.health, self.status, self.hold_s = health, status, hold_s
        self.holding = threading.Event()  # set once a request is being held unanswered
        self.paths: list[str] = []
        self._closed = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]

    def __enter__(self) -> "SilentServer":
        self._threads[0].start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.hold_s)
            head = b""
            try:
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
            except OSError:
                return
            path = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[1].decode(errors="replace")
            self.paths.append(path)
            if self.health and path.rstrip("/").endswith("/health"):
                return self._answer(conn, 200, b"OK")
            if self.status is not None:
                return self._answer(conn, self.status, b"no such endpoint here")
            self.holding.set()
            self._closed.wait(self.hold_s)  # never answers; gives up when the test ends

    @staticmethod
    def _answer(conn: socket.socket, status: int, body: bytes) -> None:
        try:
            conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n"
                         b"\r\n%s" % (status, len(body), body))
        except OSError:
            pass

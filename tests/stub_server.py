"""A stand-in HTTP server answering fixed JSON per path: for tests of the code that talks to
engines (discovery, cache flushing, the weight sync's pause / version / continue calls)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    """An HTTP server on a free port answering from `routes`: path -> list of (status, body),
    used in order (the last one repeats). A path in `hang` is never answered while the server
    runs (as a server whose worker is stuck while its HTTP side accepts requests)."""

    def __init__(
        self, routes: dict[str, list[tuple[int, object]]], hang: frozenset[str] = frozenset()
    ):
        self.routes, self.calls, self.hang = routes, [], hang
        self.released = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))  # else: a reset
                path = self.path.split("?")[0]
                stub.calls.append(path)
                if path in stub.hang:
                    stub.released.wait()
                    return
                answers = stub.routes.get(path, [(404, {"detail": "Not Found"})])
                status, body = answers.pop(0) if len(answers) > 1 else answers[0]
                text = body if isinstance(body, str) else json.dumps(body)
                self.send_response(status)
                self.end_headers()
                self.wfile.write(text.encode())

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def mute_listeners(count: int) -> list[socket.socket]:
    """Sockets on 127.0.0.1 that accept connections (the kernel's backlog) and never answer:
    engines that hang before their first byte. The caller closes them."""
    sockets = []
    for _ in range(count):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        sockets.append(listener)
    return sockets

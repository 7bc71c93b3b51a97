"""The S3 backend (aiobotocore): multipart with CRC32C, ranged parallel downloads.

Works with AWS S3, MinIO, Ceph RGW and other S3-compatible stores: the
endpoint comes from ``AWS_S3_ENDPOINT`` (the OpenShift AI data-connection key)
or ``AWS_ENDPOINT_URL``; a custom endpoint gets path-style addressing, which
those stores expect. Credentials come from the session given (the sidecar's:
``sidecar/credentials.py``), else botocore's default chain (``jitckpt ls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from functools import partial
from typing import Any

import google_crc32c
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from botocore.exceptions import ClientError

from sidecar import checksum, settle
from sidecar.config import DOWNLOAD_CONCURRENCY, DOWNLOAD_RANGE_SIZE
from sidecar.safefs import OpenedFile
from sidecar.storage import heap
from sidecar.storage.base import (
    ObjectInfo,
    ObjectTooLarge,
    PartGate,
    PutResult,
    Store,
    VerificationError,
    WrongObject,
    check_sent,
)
from sidecar.storage.retry import RetryPolicy
from sidecar.storage.slots import Slots

ENV_ENDPOINTS = ("AWS_S3_ENDPOINT", "AWS_ENDPOINT_URL")
ENV_REGION = "AWS_DEFAULT_REGION"
# Downloads write each range in pieces of this size as they arrive: ranges are large
# (fewer requests), and buffering whole ones would not fit the sidecar's memory limit.
# Small enough that a piece is still in the CPU's cache when the kernel copies it into
# the page cache: with 4 MiB pieces that copy, from memory, was over half the CPU of a
# checkpoint download here (1.9 CPU s/GB against 1.05 at 512 KiB, `perf`); smaller ones
# cost more thread hops than they save (1.9 at 64 KiB).
WRITE_CHUNK = 512 * 1024
# A body smaller than a part takes room for 1/SMALL_BODIES_PER_PART of one among those in
# flight, so small files go several per part without opening a connection each at will.
SMALL_BODIES_PER_PART = 4
MAX_PARTS = 10_000  # S3's most parts of one multipart upload
# Buffers per vectored write: well under the kernel's IOV_MAX (1024).
IOV_BATCH = 256
MISSING_CODES = ("NoSuchKey", "404", "NotFound")
# How often a periodic file's one-request upload looks whether an urgent one wants the link.
YIELD_POLL_SECONDS = 0.05

log = logging.getLogger(__name__)


async def _until_closed(gate: PartGate) -> None:
    """Return once ``gate`` is closed (an asyncio.Event says when it is set, not cleared)."""
    while gate.is_set():
        await asyncio.sleep(YIELD_POLL_SECONDS)


def _pwrite_all(fd: int, pieces: list[bytes], offset: int) -> None:
    """Write ``pieces`` one after the other at ``offset``, as one vectored write where it
    can: joining them first would copy every downloaded byte once more, which costs about
    as much CPU as the rest of a download."""
    views = [memoryview(piece) for piece in pieces if piece]
    while views:
        written = os.pwritev(fd, views[:IOV_BATCH], offset)
        if written <= 0:
            raise OSError(f"pwritev wrote {written} bytes")
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


@contextlib.contextmanager
def _bodies(data: bytes) -> Iterator[Callable[[], io.BufferedReader]]:
    """Request bodies over ``data``, one per attempt, closed on the way out.

    A body is a reader over the shared bytes, sent in small pieces: given bytes, botocore
    wraps them in a BytesIO whose buffer aiohttp takes (getbuffer), which copied every
    byte of a part once more (about 0.7 s of CPU per GB here, and twice the part in
    memory). Closed, a body lets go of the bytes: the request objects that hold it can
    outlive the request in reference cycles until the collector runs, and would hold the
    part past the room it had among those in flight."""
    made: list[io.BufferedReader] = []

    def body() -> io.BufferedReader:
        made.append(io.BufferedReader(io.BytesIO(data)))
        return made[-1]

    try:
        yield body
    finally:
        for reader in made:
            reader.close()


def _total_size(content_range: str) -> int | None:
    """The object's size a ranged answer's Content-Range states (``bytes 0-4/6``: 6)."""
    total = content_range.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def endpoint_from_env(env: Mapping[str, str]) -> str | None:
    for name in ENV_ENDPOINTS:
        if env.get(name):
            return env[name]
    return None


class S3Store(Store):
    """One job root in one bucket; use as an async context manager."""

    keeps_checksums = True

    def __init__(
        self,
        bucket: str,
        prefix: str,
        uri: str,
        *,
        part_size: int,
        concurrency: int,
        read_timeout: float,
        max_attempts: int,
        download_range_size: int = DOWNLOAD_RANGE_SIZE,
        download_concurrency: int = DOWNLOAD_CONCURRENCY,
        single_put_max: int | None = None,
        verify_ssl: bool = True,
        env: Mapping[str, str] | None = None,
        session: AioSession | None = None,
    ) -> None:
        heap.keep_transfer_buffers()  # process-wide, once
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._uri = uri
        self.part_size = part_size
        # Files up to this size go in one request (the part size unless told more).
        self.single_put_max = max(part_size, single_put_max or part_size)
        # Bytes of request bodies in flight: ``concurrency`` parts' worth (see slots.py).
        self._slots = Slots(concurrency * part_size)
        # Parts of one multipart upload under way at once (small ones share a part's room).
        self._senders = concurrency * SMALL_BODIES_PER_PART
        self.range_size = download_range_size
        self._get_slots = asyncio.Semaphore(download_concurrency)
        self.policy = RetryPolicy(attempts=max_attempts)
        source = os.environ if env is None else env
        endpoint = endpoint_from_env(source)
        config = AioConfig(
            retries={"max_attempts": min(3, max_attempts), "mode": "standard"},
            read_timeout=read_timeout,
            connect_timeout=min(10.0, read_timeout),
            max_pool_connections=max(concurrency, download_concurrency) * 2,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if endpoint else None,
        )
        self._client_cm = (session or get_session()).create_client(
            "s3",
            endpoint_url=endpoint,
            region_name=source.get(ENV_REGION) or None,
            verify=verify_ssl,
            config=config,
        )
        self._client: Any = None
        # The restore and the access probe start together, and the first of them opens
        # the client: the other waits for it rather than entering it a second time.
        self._opening = asyncio.Lock()

    @property
    def uri(self) -> str:
        return self._uri

    async def _c(self) -> Any:
        if self._client is None:
            async with self._opening:
                if self._client is None:
                    self._client = await self._client_cm.__aenter__()
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            self._client = None
            await self._client_cm.__aexit__(None, None, None)

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self._prefix) + 1 :] if self._prefix else full

    async def _pages(self, prefix: str, **extra: str) -> AsyncIterator[dict[str, Any]]:
        """Each page of the listing of ``prefix`` (ListObjectsV2, up to 1,000 entries)."""
        client = await self._c()
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self._bucket, "Prefix": self._key(prefix), **extra}
            if token:
                kwargs["ContinuationToken"] = token
            page: dict[str, Any] = await self.policy.run(
                f"list {self._uri}/{prefix}", partial(client.list_objects_v2, **kwargs)
            )
            yield page
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    async def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        async for page in self._pages(prefix):
            for item in page.get("Contents", []):
                found.append(
                    ObjectInfo(
                        key=self._rel(item["Key"]),
                        size=int(item["Size"]),
                        mtime=item["LastModified"].timestamp(),
                    )
                )
        return found

    async def list_dirs(self, prefix: str = "") -> list[str]:
        names: list[str] = []
        async for page in self._pages(prefix, Delimiter="/"):
            for item in page.get("CommonPrefixes", []):
                names.append(item["Prefix"][len(self._key(prefix)) :])
        return names

    async def head(self, key: str) -> ObjectInfo | None:
        client = await self._c()

        async def call() -> ObjectInfo | None:
            try:
                answer = await client.head_object(
                    Bucket=self._bucket, Key=self._key(key), ChecksumMode="ENABLED"
                )
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in MISSING_CODES:
                    return None
                raise
            return ObjectInfo(
                key=key,
                size=int(answer["ContentLength"]),
                mtime=answer["LastModified"].timestamp(),
                crc32c=answer.get("ChecksumCRC32C"),
            )

        return await self.policy.run(f"head {self._uri}/{key}", call)

    async def put_file(
        self,
        key: str,
        source: OpenedFile,
        crc32c: str | None = None,
        gate: PartGate | None = None,
    ) -> PutResult:
        size = source.size
        before = self.policy.retries
        if size <= self.single_put_max:
            # A body larger than a part yields to urgent uploads as parts do between them.
            yielding = gate if size > self.part_size else None
            while True:
                # Read only once the slots are held: what waits for them holds no memory.
                async with self._slot(gate, size):
                    data = await asyncio.to_thread(source.pread, 0, size)
                    await asyncio.to_thread(source.check_size)
                    sent = checksum.of_bytes(data)
                    check_sent(source.name, crc32c, sent)
                    if await self._put_unless_paused(key, data, sent, yielding):
                        break
            return PutResult(size=size, parts=1, retries=self.policy.retries - before, crc32c=sent)
        parts, sent = await self._multipart(key, source, crc32c, gate)
        return PutResult(size=size, parts=parts, retries=self.policy.retries - before, crc32c=sent)

    @contextlib.asynccontextmanager
    async def _slot(self, gate: PartGate | None, size: int) -> AsyncIterator[None]:
        """Room for a body of ``size`` bytes among those in flight, taken only while
        ``gate`` is open (re-checked once taken, so a paused upload never sits on room the
        JIT upload needs). A small body counts as a quarter part: at most four times
        ``concurrency`` requests at once."""
        count = max(size, self.part_size // SMALL_BODIES_PER_PART)
        while True:
            if gate is not None:
                await gate.wait()
            await self._slots.acquire(count)
            if gate is None or gate.is_set():
                break
            self._slots.release(count)
        try:
            yield
        finally:
            self._slots.release(count)

    async def _put_unless_paused(
        self, key: str, data: bytes, crc32c: str, gate: PartGate | None
    ) -> bool:
        """One PutObject of ``data``, cut off if ``gate`` closes before it is answered (an
        urgent upload wants the link): False then, and the caller sends it again once the
        gate opens. A periodic file of up to `single_put_max` bytes would otherwise share
        the link with a JIT upload for as long as it takes to send, where a multipart one
        gives way within a part; the bytes sent are lost, but a JIT checkpoint committed
        makes this older one useless anyway, and one that cannot be committed within the
        grace period would have had none of the link either way."""
        if gate is None:
            await self._put(key, data, crc32c)
            return True
        put = asyncio.ensure_future(self._put(key, data, crc32c))
        closed = asyncio.ensure_future(_until_closed(gate))
        try:
            await asyncio.wait({put, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (put, closed):
                if not task.done():
                    task.cancel()
            await asyncio.gather(put, closed, return_exceptions=True)
        if put.cancelled():
            log.info("put of %s/%s cut off for an urgent upload: sent again after", self._uri, key)
            return False
        put.result()
        return True

    async def _put(self, key: str, data: bytes, crc32c: str) -> None:
        """One PutObject of ``data``; the caller holds its slots."""
        client = await self._c()
        with _bodies(data) as body:
            await self.policy.run(
                f"put {self._uri}/{key}",
                lambda: client.put_object(
                    Bucket=self._bucket,
                    Key=self._key(key),
                    Body=body(),
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=crc32c,
                ),
            )

    async def _multipart(
        self, key: str, source: OpenedFile, crc32c: str | None, gate: PartGate | None
    ) -> tuple[int, str]:
        """Upload in parts; returns the part count and the file's CRC32C, combined from the
        parts' (checked against ``crc32c`` before completing, when given)."""
        client = await self._c()
        full = self._key(key)
        created = await self.policy.run(
            f"create multipart {self._uri}/{key}",
            lambda: client.create_multipart_upload(
                Bucket=self._bucket, Key=full, ChecksumAlgorithm="CRC32C"
            ),
        )
        upload_id = created["UploadId"]
        size = source.size
        # S3 takes at most MAX_PARTS parts: a file larger than that many parts gets larger ones.
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        count = (size + part_size - 1) // part_size

        async def part(number: int) -> tuple[dict[str, Any], int, int]:
            offset = (number - 1) * part_size
            length = min(part_size, size - offset)
            async with self._slot(gate, length):
                data = await asyncio.to_thread(source.pread, offset, length)
                value = google_crc32c.value(data)
                crc = checksum.encode(value)
                with _bodies(data) as body:
                    answer = await self.policy.run(
                        f"upload part {number}/{count} of {self._uri}/{key}",
                        lambda: client.upload_part(
                            Bucket=self._bucket,
                            Key=full,
                            UploadId=upload_id,
                            PartNumber=number,
                            Body=body(),
                            ChecksumCRC32C=crc,
                        ),
                    )
                sent = {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32C": crc}
                return sent, value, length

        done: list[tuple[dict[str, Any], int, int]] = []
        numbers = iter(range(1, count + 1))

        async def sender() -> None:
            # A few senders take part numbers in turn: what exists at once is bounded by
            # the senders, never by the file's size (a task per part of a huge file was
            # memory before a byte was sent).
            for number in numbers:
                done.append(await part(number))

        try:
            await asyncio.gather(*(sender() for _ in range(min(count, self._senders))))
            done.sort(key=lambda sent: int(sent[0]["PartNumber"]))
            await asyncio.to_thread(source.check_size)
            whole = checksum.encode(checksum.combine_all((v, n) for _, v, n in done))
            check_sent(source.name, crc32c, whole)
            await self.policy.run(
                f"complete multipart {self._uri}/{key}",
                lambda: client.complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": [sent for sent, _, _ in done]},
                ),
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await client.abort_multipart_upload(
                    Bucket=self._bucket, Key=full, UploadId=upload_id
                )
            raise
        return count, whole

    async def _fetch_range(
        self,
        key: str,
        fd: int,
        start: int,
        length: int,
        file_lock: threading.Lock,
        *,
        size: int,
        base: int,
    ) -> int:
        """GET one range of the ``size``-byte object ``key`` and write it at its offset
        (from ``base`` in the file) as it streams in, in pieces of at most WRITE_CHUNK, so
        memory stays bounded whatever the range size; returns its CRC32C (a retry rewrites
        the whole range and starts the CRC over). The answer's Content-Range says the
        object's size: another one than ``size``, or no object at all, is a WrongObject,
        at no extra request."""
        client = await self._c()

        def write(pieces: list[bytes], offset: int, crc: int) -> int:
            with file_lock:
                _pwrite_all(fd, pieces, offset)
            for piece in pieces:
                crc = int(google_crc32c.extend(crc, piece))
            return crc

        async def call() -> int:
            try:
                answer = await client.get_object(
                    Bucket=self._bucket,
                    Key=self._key(key),
                    Range=f"bytes={start}-{start + length - 1}",
                )
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in MISSING_CODES:
                    raise WrongObject(f"missing object {key}") from exc
                if code == "InvalidRange":
                    raise WrongObject(f"{key} is shorter than {size} bytes") from exc
                raise
            stored = _total_size(answer.get("ContentRange", ""))
            if stored is not None and stored != size:
                raise WrongObject(f"{key} is {stored} bytes, the manifest says {size}")
            crc = 0
            received = 0
            pieces: list[bytes] = []
            pending = 0
            async with answer["Body"] as body:
                while chunk := await body.read(WRITE_CHUNK - pending):
                    pieces.append(chunk)
                    pending += len(chunk)
                    if pending >= WRITE_CHUNK:
                        crc = await settle.in_thread(write, pieces, base + start + received, crc)
                        received += pending
                        pieces, pending = [], 0
            if pieces:
                crc = await settle.in_thread(write, pieces, base + start + received, crc)
                received += pending
            if received != length:
                raise VerificationError(
                    f"range {start}+{length} of {key} came back with {received} bytes"
                )
            return crc

        async with self._get_slots:
            return await self.policy.run(f"get {self._uri}/{key} @{start}", call)

    async def get_file(
        self, key: str, fd: int, size: int, crc32c: str, offset: int | None = None
    ) -> None:
        """Ranged parallel download; each range's CRC32C is taken while its bytes are in
        memory and the ranges' CRCs are combined, so the file is never read back. An empty
        file takes no range: its one request is a HEAD, that it is there and empty."""
        if size == 0:
            info = await self.head(key)
            if info is None:
                raise WrongObject(f"missing object {key}")
            if info.size:
                raise WrongObject(f"{key} is {info.size} bytes, the manifest says 0")
        if offset is None:
            os.ftruncate(fd, size)
        # One write into the file at a time: concurrent writers of one file queue on its
        # inode lock in the kernel, spinning on the CPU while the holder copies (most of a
        # download's CPU here); waiting on this lock costs none.
        file_lock = threading.Lock()

        async def fetch(start: int) -> tuple[int, int]:
            length = min(self.range_size, size - start)
            crc = await self._fetch_range(
                key, fd, start, length, file_lock, size=size, base=offset or 0
            )
            return crc, length

        ranges = await settle.all_or_none(fetch(s) for s in range(0, size, self.range_size))
        actual = checksum.encode(checksum.combine_all(ranges))
        if actual != crc32c:
            raise VerificationError(f"{key}: CRC32C {actual} does not match manifest {crc32c}")

    async def put_bytes(self, key: str, data: bytes) -> None:
        async with self._slot(None, len(data)):
            await self._put(key, data, checksum.of_bytes(data))

    async def get_bytes(self, key: str, max_size: int) -> bytes:
        client = await self._c()

        async def call() -> bytes:
            answer = await client.get_object(Bucket=self._bucket, Key=self._key(key))
            async with answer["Body"] as body:
                if int(answer.get("ContentLength", 0)) > max_size:
                    raise ObjectTooLarge(
                        f"{key} is {answer['ContentLength']} bytes, more than {max_size}"
                    )
                # read(n) returns what has arrived, up to n: read on to the end, never more
                # than max_size + 1 bytes whatever the length header says
                pieces: list[bytes] = []
                received = 0
                while received <= max_size and (piece := await body.read(max_size + 1 - received)):
                    pieces.append(piece)
                    received += len(piece)
                data = b"".join(pieces)
            if len(data) > max_size:
                raise ObjectTooLarge(f"{key} is more than {max_size} bytes")
            return data

        return await self.policy.run(f"get {self._uri}/{key}", call)

    async def delete(self, keys: list[str]) -> None:
        client = await self._c()
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            await self.policy.run(
                f"delete {len(batch)} objects under {self._uri}",
                partial(
                    client.delete_objects,
                    Bucket=self._bucket,
                    Delete={"Objects": batch, "Quiet": True},
                ),
            )

"""Where stored images live: a directory (the embedded default; the REST front serves it at signed URLs) or an
S3-compatible bucket (boto3; presigned GET URLs, the bucket serves them).

Both take keys made by urls.object_key and refuse any other (a disk path is built from a validated key only). Both
write whole objects only: a disk object appears by rename, an S3 object by one PUT, so a reader never sees half an
image. ``sweep`` removes what is older than a time whoever or whatever wrote it: images of runs that died before
their result was recorded, which nothing else names.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar, runtime_checkable

from .urls import CONTENT_TYPES, UrlSigner, ext_of_key, tenant_tag_of_key

S3_SCHEME = "s3://"
# S3 DeleteObjects takes at most this many keys per call.
S3_DELETE_BATCH = 1000
S3_MAX_PRESIGN_S = 7 * 86400
_TAG_DIR_RE = re.compile(r"[0-9a-f]{16}", re.ASCII)
_TOKEN_DIR_RE = re.compile(r"[0-9a-f]{32}", re.ASCII)
# A disk put's temporary file, next to its object: ".{index}.{ext}.{random}.tmp".
_TMP_RE = re.compile(r"\.(0|[1-9][0-9]{0,3})\.(png|jpeg|webp)\.[0-9a-f]{16}\.tmp", re.ASCII)
# S3 bucket names: 3-63 of lower-case letters, digits, dots and hyphens.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", re.ASCII)
T = TypeVar("T")
# A put whose directory a delete keeps removing (it was empty) makes it again, this many times at most.
_PUT_TRIES = 100


class ImageStoreUnavailable(Exception):
    """The store could not be reached or refused the call (S3 down, credentials refused): the caller retries later
    or fails the request as unavailable; it is never the client's fault."""


@runtime_checkable
class ImageStore(Protocol):
    async def put(self, key: str, data: bytes, content_type: str) -> None: ...

    async def get(self, key: str) -> bytes | None: ...

    async def delete(self, keys: Iterable[str]) -> None: ...

    def url(self, key: str, now: float, not_after: float | None = None) -> tuple[str, int]:
        """(a URL the object can be fetched at without a key, when it stops working)."""
        ...

    async def sweep(self, older_than: float) -> int:
        """Delete the objects last written before ``older_than`` (unix seconds); how many went."""
        ...


def _checked(key: str) -> str:
    if tenant_tag_of_key(key) is None:
        raise ValueError(f"not an object key: {key!r}")
    return key


class DiskImageStore:
    """Objects as files ``root/{tag}/{token}/{index}.{ext}``, mode 0644 (the REST front may run as another user).
    ``public_url``: the REST front's public base (``--public-url``), making URLs absolute; None: paths from /."""

    def __init__(self, root: Path, signer: UrlSigner, public_url: str | None = None) -> None:
        self.root = Path(root)
        self.signer = signer
        self.public_url = public_url.rstrip("/") if public_url else None

    def __repr__(self) -> str:
        return f"DiskImageStore({str(self.root)!r})"

    def path_of(self, key: str) -> Path | None:
        """The file a key names; None for anything that is not a key. The only way a path is made from a key."""
        return None if tenant_tag_of_key(key) is None else self.root.joinpath(*key.split("/"))

    def _put(self, key: str, data: bytes) -> None:
        path = self.path_of(_checked(key))
        assert path is not None
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        for tries_left in range(_PUT_TRIES - 1, -1, -1):
            path.parent.mkdir(parents=True, exist_ok=True)  # two writers racing on a new directory are both fine
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                break
            except FileNotFoundError:  # a delete removed the directory while it was empty: make it again
                if not tries_left:
                    raise
        f = os.fdopen(fd, "wb")
        try:
            with f:
                os.fchmod(f.fileno(), 0o644)  # whatever the umask: the REST front reads what the gateway wrote
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the job's result is recorded next: its images must be on disk by then
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    async def put(self, key: str, data: bytes, content_type: str = "") -> None:
        await asyncio.to_thread(self._put, key, data)

    def open(self, key: str) -> BinaryIO | None:
        """The object's file, open for reading (blocking; the caller runs it in a thread), or None when there is
        none. Once open it can be read to the end even if a sweep deletes it meanwhile."""
        path = self.path_of(key)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink where an object should be: not one of ours
                return None
            raise
        return os.fdopen(fd, "rb")

    def _get(self, key: str) -> bytes | None:
        f = self.open(key)
        if f is None:
            return None
        with f:
            return f.read()

    async def get(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self._get, key)

    def _delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self.path_of(key)
            if path is None:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            _remove_if_empty(path.parent)  # the answer's last image: its directory goes too

    async def delete(self, keys: Iterable[str]) -> None:
        await asyncio.to_thread(self._delete, list(keys))

    def url(self, key: str, now: float, not_after: float | None = None) -> tuple[str, int]:
        path, expires = self.signer.sign(key, now, not_after)
        return (path if self.public_url is None else self.public_url + path), expires

    def _sweep(self, older_than: float) -> int:
        # Only names this store makes are looked at, three levels deep: a root pointed at the wrong directory
        # loses nothing else.
        removed = 0
        for tag in _entries(self.root, _TAG_DIR_RE):
            for token in _entries(tag.path, _TOKEN_DIR_RE):
                swept_here = False
                for entry in _entries(token.path, None):
                    key = f"{tag.name}/{token.name}/{entry.name}"
                    if not _TMP_RE.fullmatch(entry.name) and tenant_tag_of_key(key) is None:
                        continue
                    try:
                        if entry.stat(follow_symlinks=False).st_mtime < older_than:
                            os.unlink(entry.path)
                            removed += 1
                            swept_here = True
                    except FileNotFoundError:  # deleted meanwhile
                        pass
                # An empty directory goes if this sweep emptied it or it is old: a new one may be a put's, about
                # to be written in.
                if swept_here or _mtime(token.path) < older_than:
                    _remove_if_empty(Path(token.path))
        return removed

    async def sweep(self, older_than: float) -> int:
        return await asyncio.to_thread(self._sweep, older_than)


def _entries(directory: str | Path, pattern: re.Pattern[str] | None) -> list[os.DirEntry[str]]:
    """The entries of ``directory`` (directories matching ``pattern``, or the plain files when None)."""
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    if pattern is None:
        return [e for e in entries if e.is_file(follow_symlinks=False)]
    return [e for e in entries if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def _mtime(path: str) -> float:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return float("inf")


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty (a writer got there), or gone
        pass


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3ImageStore:
    """Objects in an S3-compatible bucket under ``prefix``; their URLs are presigned GETs, served by the bucket.

    ``signer_ttl``: how long a URL is good for at most (``--url-ttl``, as for the disk store). ``endpoint_url``:
    another S3 than AWS's (``--s3-endpoint``; else boto3 reads $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL);
    credentials and region come from the usual AWS environment and files. boto3 blocks, so every call that talks to
    the bucket runs in a thread; presigning is local."""

    def __init__(self, bucket: str, prefix: str, signer_ttl: float, endpoint_url: str | None = None,
                 region: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        if not _BUCKET_RE.fullmatch(bucket):
            raise ValueError(f"not an S3 bucket name: {bucket!r}")
        if not signer_ttl > 0:
            raise ValueError(f"a URL's lifetime must be positive, not {signer_ttl}")
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.ttl = float(signer_ttl)
        # Path-style addressing for a named endpoint: S3-compatible servers (MinIO, Ceph, moto) and IP literals
        # have no per-bucket host names; AWS itself keeps boto3's choice.
        named = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(signature_version="s3v4", retries={"max_attempts": 3, "mode": "standard"},
                        connect_timeout=5, read_timeout=30,
                        s3={"addressing_style": "path"} if named else None)
        try:
            self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region,
                                                          config=config)
        except Exception as exc:  # botocore's configuration errors (a bad endpoint URL, an unknown profile...)
            raise ValueError(f"S3 client for bucket {bucket}: {exc}") from exc

    def __repr__(self) -> str:
        return f"S3ImageStore('s3://{self.bucket}/{self.prefix}')"

    def _s3_key(self, key: str) -> str:
        return self.prefix + _checked(key)

    async def _call(self, what: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """``fn(**kwargs)`` in a thread; whatever botocore raises as ImageStoreUnavailable."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return await asyncio.to_thread(fn, **kwargs)
        except ClientError as exc:
            err = exc.response.get("Error", {})
            raise ImageStoreUnavailable(f"S3 {what} in bucket {self.bucket}: {err.get('Code')}: "
                                        f"{err.get('Message')}") from exc
        except BotoCoreError as exc:
            raise ImageStoreUnavailable(f"S3 {what} in bucket {self.bucket}: {exc}") from exc

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        await self._call("put", self._client.put_object, Bucket=self.bucket, Key=self._s3_key(key), Body=data,
                         ContentType=content_type or CONTENT_TYPES[ext_of_key(key)])

    async def get(self, key: str) -> bytes | None:
        if tenant_tag_of_key(key) is None:
            return None
        from botocore.exceptions import ClientError

        def read() -> bytes | None:
            try:
                answer = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            body = answer["Body"]
            try:
                return body.read()
            finally:
                body.close()

        return await self._call("get", read)

    async def _delete_s3_keys(self, s3_keys: Sequence[str]) -> None:
        for start in range(0, len(s3_keys), S3_DELETE_BATCH):
            batch = s3_keys[start:start + S3_DELETE_BATCH]
            answer = await self._call("delete", self._client.delete_objects, Bucket=self.bucket,
                                      Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            if errors := answer.get("Errors"):  # a missing key is no error (S3 deletes idempotently)
                first = errors[0]
                raise ImageStoreUnavailable(f"S3 delete in bucket {self.bucket}: {len(errors)} of {len(batch)} "
                                            f"failed, {first.get('Key')}: {first.get('Code')}: {first.get('Message')}")

    async def delete(self, keys: Iterable[str]) -> None:
        await self._delete_s3_keys([self.prefix + k for k in keys if tenant_tag_of_key(k) is not None])

    def url(self, key: str, now: float, not_after: float | None = None) -> tuple[str, int]:
        from botocore.exceptions import BotoCoreError, ClientError

        # SigV4 presigned URLs last 7 days at most (S3 refuses a longer X-Amz-Expires).
        until = min(now + self.ttl, now + S3_MAX_PRESIGN_S, math.inf if not_after is None else not_after)
        expires = max(0, int(until))
        try:
            url = self._client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self._s3_key(key)},
                ExpiresIn=max(1, expires - int(now)))  # S3 counts from the signing second
        except (BotoCoreError, ClientError) as exc:  # no credentials to sign with
            raise ImageStoreUnavailable(f"S3 presign in bucket {self.bucket}: {exc}") from exc
        return url, expires

    async def sweep(self, older_than: float) -> int:
        def listed() -> list[str]:
            old = []
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                                 Prefix=self.prefix):
                for obj in page.get("Contents", ()):
                    # Only what this store names: a prefix shared with other data loses nothing else.
                    if (tenant_tag_of_key(obj["Key"][len(self.prefix):]) is not None
                            and obj["LastModified"].timestamp() < older_than):
                        old.append(obj["Key"])
            return old

        old = await self._call("list", listed)
        await self._delete_s3_keys(old)
        return len(old)


def open_image_store(spec: str, signer: UrlSigner, public_url: str | None = None,
                     s3_endpoint: str | None = None) -> ImageStore:
    """``--image-store``: ``s3://BUCKET[/PREFIX]`` for a bucket, a directory path for the disk store."""
    if spec.startswith(S3_SCHEME):
        bucket, _, prefix = spec[len(S3_SCHEME):].partition("/")
        return S3ImageStore(bucket, prefix, signer.ttl, endpoint_url=s3_endpoint)
    if not spec or "://" in spec:
        raise ValueError(f"--image-store: a directory or s3://BUCKET/PREFIX, not {spec!r}")
    return DiskImageStore(Path(spec).expanduser(), signer, public_url)

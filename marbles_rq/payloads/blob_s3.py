"""The S3 blob backend, MARBLES_BLOB_STORE=s3://bucket/prefix: one object per blob,
``<prefix>/<sha[:2]>/<sha>``, through boto3 (``pip install 'marbles-rq[s3]'``). Credentials
and region come from boto3's usual sources (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION, a profile, an instance role); MARBLES_S3_ENDPOINT points it at an
S3-compatible server (MinIO, Ceph, moto_server). A PUT is atomic on S3: a reader sees the
whole object or none. Holders and the index are in Redis."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from ..errors import ConfigError
from .blob_base import BlobMissing, BlobRef, HeldBlobs

if TYPE_CHECKING:
    from ..store import RedisStore

S3_ENDPOINT_ENV = "MARBLES_S3_ENDPOINT"


class S3Blobs(HeldBlobs):
    name = "s3"

    def __init__(self, store: RedisStore, bucket: str, prefix: str, url: str) -> None:
        super().__init__(store)
        self.bucket, self.prefix, self.url = bucket, prefix, url
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3  # type: ignore[import-untyped]
            except ImportError:
                raise ConfigError("an s3:// blob store needs boto3: pip install "
                                  "'marbles-rq[s3]'") from None
            self._client = boto3.client("s3", endpoint_url=os.environ.get(S3_ENDPOINT_ENV)
                                        or None)
        return self._client

    def key(self, sha: str) -> str:
        return "/".join(p for p in (self.prefix, sha[:2], sha) if p)

    def _write(self, sha: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(sha), Body=data)

    def _read(self, sha: str) -> bytes | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(sha))["Body"]
        except self.client.exceptions.NoSuchKey:
            return None
        return cast(bytes, body.read())

    def _exists(self, sha: str) -> bool:
        from botocore.exceptions import ClientError  # type: ignore[import-untyped]
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(sha))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def open(self, ref: BlobRef) -> BinaryIO:
        if self._in_redis(ref):
            return super().open(ref)  # a small blob, kept in Redis
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(ref.sha256))["Body"]
        except self.client.exceptions.NoSuchKey:
            raise BlobMissing(f"blob {ref.sha256} is missing from the s3 blob store "
                              f"{self.url}") from None
        return cast(BinaryIO, body)

    def delete_object(self, sha: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(sha))

    def probe(self) -> str:
        key = "/".join(p for p in (self.prefix, f".probe.{uuid.uuid4().hex[:8]}") if p)
        self.client.put_object(Bucket=self.bucket, Key=key, Body=b"marbles-rq")
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            if got != b"marbles-rq":
                raise OSError(f"s3://{self.bucket}/{key} did not read back what was written")
        finally:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        endpoint = os.environ.get(S3_ENDPOINT_ENV)
        return f"s3 blob store {self.url}{f' at {endpoint}' if endpoint else ''} (writable)"

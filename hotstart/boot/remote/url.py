"""`s3://BUCKET/PREFIX` and `NAME=s3://BUCKET/PREFIX` model specs (string parsing only: no imports)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hotstart.errors import HotstartError

# S3's bucket naming rules (3-63 characters of lowercase letters, digits, dots and hyphens, starting and
# ending with a letter or digit); S3-compatible stores accept the same or fewer.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
# a served model name (NAME=...): what --served-model-name accepts, no "=" or "/" at the start
_NAME = re.compile(r"^[A-Za-z0-9_.\-][A-Za-z0-9_.:\-/]{0,127}$")
SCHEMES = ("s3://",)


@dataclass(frozen=True)
class RemoteSpec:
    """A model in object storage: bucket, prefix (no leading or trailing '/'; '' for the bucket's root)
    and the name to serve it under (NAME= or the prefix's last part)."""

    bucket: str
    prefix: str
    name: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, name: str) -> str:
        """The object key of file NAME under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name


def is_remote(spec: str | None) -> bool:
    """True for `s3://...` and `NAME=s3://...` (other specs are folders or hub ids)."""
    if not spec:
        return False
    head, sep, tail = spec.partition("=")
    return spec.startswith(SCHEMES) or (bool(sep) and "/" not in head and tail.startswith(SCHEMES))


def parse_remote(spec: str) -> RemoteSpec:
    """Parse a remote spec; HotstartError with a one-line reason if it is malformed."""
    name = None
    url = spec
    if not spec.startswith(SCHEMES):
        name, _, url = spec.partition("=")
        if not _NAME.match(name):
            raise HotstartError(
                f"model '{spec}': '{name}' is not a valid model name (letters, digits, '._-:/')"
            )
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise HotstartError(f"model '{spec}': '{bucket}' is not a valid S3 bucket name")
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts) or any(c in prefix for c in "\0\\?#*"):
        raise HotstartError(f"model '{spec}': invalid prefix '{prefix}' (empty, '.' or '..' parts, or ?#*\\)")
    if name is None:
        name = parts[-1] if parts else bucket
    return RemoteSpec(bucket=bucket, prefix=prefix, name=name)

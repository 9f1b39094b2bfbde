"""The S3 client (obstore) configured the way the AWS SDKs are, listing and ranged GETs, one-line errors.

Why obstore (docs/remote.md has the figures): it imports in ~25-55 ms with no Python HTTP stack (boto3
with a client: ~530-650 ms, on the API process's main thread at t=0), its requests run on its own Rust
threads with the GIL released, and it returns each body as one buffer that os.pwrite takes without a
copy. It never imports torch and starts no interpreter.

Where settings come from, in the AWS SDKs' order:
  endpoint     AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's endpoint_url; else AWS's regional one
  region       AWS_REGION, AWS_DEFAULT_REGION, the profile's region; else us-east-1
  credentials  AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN); else the profile
               (AWS_PROFILE, else "default") in AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE (~/.aws/...):
               static keys are read here, any other kind (SSO, role, credential_process) through botocore
               (boto3 must be installed; imported only then); else obstore's chain: web identity token,
               container credentials, the instance role (IMDS)
Credentials are never logged, printed or put in an error message.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import obstore
from obstore.store import S3Store

from hotstart.boot.remote.source import StoreError
from hotstart.errors import HotstartError

CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30  # per read of a body: a stalled connection fails (and is retried) after this
REQUEST_TIMEOUT_S = 300
RETRIES = 5  # obstore retries 5xx, dropped connections and timeouts with exponential backoff + jitter
RETRY_TIMEOUT_S = 60
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")


def _profile(name: str, env) -> dict[str, str]:
    """The profile NAME's settings from the shared credentials and config files (later wins)."""
    import configparser

    out: dict[str, str] = {}
    home = os.path.expanduser("~")
    files = (
        (
            env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
            "default" if name == "default" else f"profile {name}",
        ),
        (env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"), name),
    )
    for path, section in files:
        if not os.path.isfile(path):
            continue
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError) as e:
            raise HotstartError(f"cannot read AWS settings file {path}: {type(e).__name__}") from None
        if parser.has_section(section):
            out.update({k: v.strip() for k, v in parser.items(section)})
    return out


def store_settings(environ: dict[str, str] | None = None) -> tuple[dict, str, str]:
    """(obstore S3 config without the bucket, endpoint for messages, how credentials were found)."""
    env = os.environ if environ is None else environ
    profile_name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    keys = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    profile = (
        {}
        if all(keys) and (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))
        else _profile(profile_name, env)
    )
    config: dict = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or profile.get("endpoint_url")
    if endpoint:
        config["endpoint"] = endpoint.rstrip("/")
    config["region"] = (
        env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or profile.get("region") or "us-east-1"
    )
    if all(keys):
        config.update(access_key_id=keys[0], secret_access_key=keys[1])
        if env.get("AWS_SESSION_TOKEN"):
            config["session_token"] = env["AWS_SESSION_TOKEN"]
        how = "environment"
    elif profile.get("aws_access_key_id") and profile.get("aws_secret_access_key"):
        config.update(
            access_key_id=profile["aws_access_key_id"], secret_access_key=profile["aws_secret_access_key"]
        )
        if profile.get("aws_session_token"):
            config["session_token"] = profile["aws_session_token"]
        how = f"profile {profile_name}"
    elif profile:
        how = f"profile {profile_name} (botocore)"
    else:
        how = "default chain (web identity, container, instance role)"
    shown = config.get("endpoint") or f"AWS S3 ({config['region']})"
    return config, shown, how


def open_store(
    bucket: str,
    environ: dict[str, str] | None = None,
    retries: int = RETRIES,
    retry_timeout_s: float = RETRY_TIMEOUT_S,
) -> tuple[S3Store, str, str]:
    """(store for BUCKET, endpoint as shown in messages, credential source)."""
    config, shown, how = store_settings(environ)
    provider = None
    if how.endswith("(botocore)"):
        try:
            import boto3
            from obstore.auth.boto3 import Boto3CredentialProvider
        except ImportError:
            raise HotstartError(
                f"AWS {how.removesuffix(' (botocore)')} has no static keys; its credentials "
                "(SSO, role, credential_process) need boto3: pip install boto3"
            ) from None
        provider = Boto3CredentialProvider(boto3.session.Session(profile_name=how.split()[1]))
    client = {
        "connect_timeout": timedelta(seconds=CONNECT_TIMEOUT_S),
        "timeout": timedelta(seconds=REQUEST_TIMEOUT_S),
        "read_timeout": timedelta(seconds=READ_TIMEOUT_S),
    }
    if config.get("endpoint", "").startswith("http://"):
        client["allow_http"] = True
    retry = {
        "max_retries": retries,
        "retry_timeout": timedelta(seconds=retry_timeout_s),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=5),
            "base": 2,
        },
    }
    try:
        store = S3Store(
            bucket, config=config, client_options=client, retry_config=retry, credential_provider=provider
        )
    except Exception as e:  # noqa: BLE001 - obstore raises its own types for bad settings
        raise HotstartError(
            f"s3://{bucket}: bad S3 settings ({endpoint_hint(shown)}): {_first_line(e)}"
        ) from None
    return store, shown, how


def endpoint_hint(shown: str) -> str:
    return f"endpoint {shown}"


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def describe(e: BaseException, what: str, shown: str) -> StoreError:
    """A one-line StoreError for a failed request on WHAT (no credentials: obstore's messages carry the
    URL, the status and the store's error code, never the signature)."""
    text = str(e)
    status = int(m.group(1)) if (m := _STATUS.search(text)) else None
    code = m.group(1) if (m := _CODE.search(text)) else None
    if isinstance(e, FileNotFoundError) or code in ("NoSuchKey", "NoSuchBucket") or status == 404:
        reason = "no such bucket" if code == "NoSuchBucket" else "not found"
    elif status in (401, 403) or isinstance(
        e, (obstore.exceptions.PermissionDeniedError, obstore.exceptions.UnauthenticatedError)
    ):
        reason = f"access denied ({code or status}): check the credentials and their permissions"
    elif isinstance(e, obstore.exceptions.PreconditionError) or status == 412:
        reason = "the object changed on the store during the download (ETag no longer matches)"
    elif status is not None:
        reason = f"HTTP {status}{f' {code}' if code else ''}"
    elif "error sending request" in text or "connect" in text.lower():
        reason = "cannot reach the store"
    elif "timed out" in text.lower() or "timeout" in text.lower():
        reason = "timed out"
    else:
        reason = _first_line(e)
    retried = " after retries" if (status is None and "retries" in text) or (status or 0) >= 500 else ""
    return StoreError(f"{what}: {reason}{retried} ({endpoint_hint(shown)})", status, code)


def list_prefix(store: S3Store, prefix: str) -> list[dict]:
    """The objects directly under PREFIX (one ListObjectsV2 per 1000 keys): dicts with name, size, etag."""
    listed = obstore.list_with_delimiter(store, f"{prefix}/" if prefix else None)
    cut = len(prefix) + 1 if prefix else 0
    return [
        {"name": o["path"][cut:], "size": int(o["size"]), "etag": o.get("e_tag") or ""}
        for o in listed["objects"]
        if "/" not in o["path"][cut:]
    ]


def get_range(store: S3Store, key: str, start: int, end: int, etag: str):
    """Bytes [start, end) of KEY if its ETag is still ETAG (a buffer; shorter if the object is)."""
    options = {"range": (start, end)}
    if etag:
        options["if_match"] = etag
    return obstore.get(store, key, options=options).bytes()

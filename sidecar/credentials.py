"""The store's credentials: the Secret's files, or the pod's own identity, never the node's.

The webhook gives the sidecar one of two things (DESIGN section 3):

- the ``s3-secret`` as read-only files (the keys of an OpenShift AI data
  connection). The kubelet rotates such a volume by writing the new version
  into a fresh directory and swapping the ``..data`` link to it in one rename,
  so the files are re-read whenever that link changes: a rotated Secret is
  used by a running job, and the two keys are always read from one version.
- with no Secret, the pod's workload identity, copied from the trainer (or
  added by the identity webhook itself): IRSA (``AWS_ROLE_ARN`` and a token
  file, exchanged at STS and refreshed before the temporary keys expire) or
  EKS Pod Identity (a credentials URI and a token file).

botocore's default chain would end at the instance metadata service, the
node's role: a different and usually broader identity than the job's. It is
never consulted. What is used, and where it came from, is said at start (log
and ``/status``); the values themselves never are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.credentials import (
    AioAssumeRoleWithWebIdentityCredentialFetcher,
    AioContainerProvider,
    AioCredentialResolver,
    AioDeferredRefreshableCredentials,
    AioEnvProvider,
    AioRefreshableCredentials,
    _get_client_creator,
)
from aiobotocore.session import AioSession, get_session
from botocore.credentials import CredentialProvider
from botocore.utils import FileWebIdentityTokenLoader

log = logging.getLogger(__name__)

ACCESS_KEY = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN = "AWS_SESSION_TOKEN"
# Keys of the data connection that are not credentials: where the store is.
STORE_KEYS = ("AWS_S3_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
SECRET_FILES = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN, *STORE_KEYS)
DATA_LINK = "..data"  # the kubelet's link to the current version of a Secret volume
MAX_VALUE = 64 * 1024
ROLE_ARN = "AWS_ROLE_ARN"
TOKEN_FILE = "AWS_WEB_IDENTITY_TOKEN_FILE"
SESSION_NAME = "AWS_ROLE_SESSION_NAME"
CONTAINER_URI = "AWS_CONTAINER_CREDENTIALS_FULL_URI"
CONTAINER_TOKEN_FILE = "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"
# botocore's refresh windows for temporary credentials (before expiry: try, must).
ADVISORY_SECONDS = 15 * 60
MANDATORY_SECONDS = 10 * 60
# AWS STS's shortest DurationSeconds, which botocore checks before sending. Shorter is only
# for a local STS (tests of the refresh), so only then is that check turned off.
STS_MIN_DURATION = 900
_NEVER = datetime(9999, 1, 1, tzinfo=UTC)


class CredentialsError(Exception):
    """No usable credentials: the message says what was looked for."""


@dataclass(frozen=True)
class Identity:
    """Which identity the sidecar uses and where it came from (no secret in it)."""

    kind: str  # "s3-secret", "irsa", "eks-pod-identity" or "environment"
    source: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "source": self.source}


Loader = Callable[[AioSession], Awaitable[Any]]


@dataclass(frozen=True)
class StoreAccess:
    """An identity, the credentials it loads, and the store settings that came with it."""

    identity: Identity
    load: Loader
    store_env: dict[str, str] = field(default_factory=dict)

    def session(self) -> AioSession:
        session = get_session()
        session.register_component(
            "credential_provider", AioCredentialResolver([_Provider(self.load, session)])
        )
        return session


class _Provider(CredentialProvider):
    METHOD = "jitckpt"

    def __init__(self, load: Loader, session: AioSession) -> None:
        super().__init__()
        self._load = load
        self._session = session

    async def load(self) -> Any:
        return await self._load(self._session)


# --- the Secret's files -------------------------------------------------------


def _read_value(name: str, dir_fd: int) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_VALUE + 1)
    if len(data) > MAX_VALUE:
        raise CredentialsError(f"{name} in the s3-secret is larger than {MAX_VALUE} bytes")
    return data.decode("utf-8", "replace").strip()


def _open_version(directory: Path) -> int:
    """The directory of the Secret's current version: the ``..data`` target the kubelet
    swaps, or ``directory`` itself where the files lie flat."""
    link = directory / DATA_LINK
    target = link if os.path.lexists(link) else directory
    return os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _version_of(dir_fd: int) -> tuple[int, ...]:
    found: list[int] = [os.fstat(dir_fd).st_ino]
    for name in SECRET_FILES:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            found += [0, 0]
            continue
        found += [st.st_ino, st.st_mtime_ns]
    return tuple(found)


def secret_version(directory: Path) -> tuple[int, ...]:
    dir_fd = _open_version(directory)
    try:
        return _version_of(dir_fd)
    finally:
        os.close(dir_fd)


def read_secret(directory: Path) -> tuple[tuple[int, ...], dict[str, str]]:
    """One consistent version of the Secret's keys (all read from the same directory)."""
    try:
        dir_fd = _open_version(directory)
    except OSError as exc:
        raise CredentialsError(f"cannot open the s3-secret at {directory}: {exc}") from None
    try:
        version = _version_of(dir_fd)
        values = {n: v for n in SECRET_FILES if (v := _read_value(n, dir_fd))}
    except OSError as exc:
        raise CredentialsError(f"cannot read the s3-secret at {directory}: {exc}") from None
    finally:
        os.close(dir_fd)
    missing = [k for k in (ACCESS_KEY, SECRET_KEY) if k not in values]
    if missing:
        raise CredentialsError(f"the s3-secret at {directory} has no {' or '.join(missing)}")
    return version, values


class SecretFileCredentials(AioRefreshableCredentials):
    """Keys from the Secret's files, re-read as soon as the kubelet swapped in a new version.

    The check is a few ``stat`` calls before each request; a version caught half
    written (a flat directory being rewritten) is read again at the next one."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._version, values = read_secret(directory)
        super().__init__(
            values[ACCESS_KEY],
            values[SECRET_KEY],
            values.get(SESSION_TOKEN),
            _NEVER,
            self._reload,
            "s3-secret-files",
        )

    def refresh_needed(self, refresh_in: int | None = None) -> bool:
        try:
            return secret_version(self._directory) != self._version
        except OSError:
            return False  # between two versions: keep the current keys for this request

    def _reload(self) -> dict[str, Any]:
        version, values = read_secret(self._directory)
        self._version = version
        log.info("the s3-secret's files changed: using the new version")
        return {
            "access_key": values[ACCESS_KEY],
            "secret_key": values[SECRET_KEY],
            "token": values.get(SESSION_TOKEN),
            "expiry_time": _NEVER.isoformat(),
        }


def _from_secret(directory: Path) -> StoreAccess:
    _, values = read_secret(directory)  # fail at start, not at the first request

    async def load(session: AioSession) -> Any:
        return SecretFileCredentials(directory)

    store_env = {k: values[k] for k in STORE_KEYS if k in values}
    identity = Identity("s3-secret", f"files of the s3-secret at {directory}")
    return StoreAccess(identity, load, store_env)


# --- the pod's workload identity ----------------------------------------------


class _TemporaryCredentials(AioDeferredRefreshableCredentials):
    """STS keys, refreshed ``advisory`` seconds before they expire (``mandatory``: must)."""

    def __init__(
        self, refresh_using: Callable[[], Any], method: str, advisory: int, mandatory: int
    ) -> None:
        super().__init__(refresh_using=refresh_using, method=method)
        self._advisory_refresh_timeout = advisory
        self._mandatory_refresh_timeout = mandatory


def _windows(duration: int | None) -> tuple[int, int]:
    if duration is None:
        return ADVISORY_SECONDS, MANDATORY_SECONDS
    return min(ADVISORY_SECONDS, duration // 2), min(MANDATORY_SECONDS, duration // 4)


def _sts_client_creator(session: AioSession, region: str | None, duration: int | None) -> Any:
    creator = _get_client_creator(session, region)
    if duration is None or duration >= STS_MIN_DURATION:
        return creator

    def relaxed(service: str, **kwargs: Any) -> Any:
        unchecked = AioConfig(parameter_validation=False)
        config = kwargs.pop("config", None)
        return creator(service, config=config.merge(unchecked) if config else unchecked, **kwargs)

    return relaxed


def _from_irsa(env: Mapping[str, str], duration: int | None) -> StoreAccess:
    role, token = env[ROLE_ARN], env[TOKEN_FILE]
    advisory, mandatory = _windows(duration)
    extra: dict[str, Any] = {}
    if env.get(SESSION_NAME):
        extra["RoleSessionName"] = env[SESSION_NAME]
    if duration is not None:
        extra["DurationSeconds"] = duration

    async def load(session: AioSession) -> Any:
        fetcher = AioAssumeRoleWithWebIdentityCredentialFetcher(
            client_creator=_sts_client_creator(session, env.get("AWS_REGION"), duration),
            web_identity_token_loader=FileWebIdentityTokenLoader(token),
            role_arn=role,
            extra_args=extra,
            cache={},
            expiry_window_seconds=advisory,
        )
        return _TemporaryCredentials(
            fetcher.fetch_credentials, "assume-role-with-web-identity", advisory, mandatory
        )

    source = f"role {role} (IRSA), web identity token {token}"
    return StoreAccess(Identity("irsa", source), load)


def _from_pod_identity(env: Mapping[str, str]) -> StoreAccess:
    async def load(session: AioSession) -> Any:
        return await AioContainerProvider(environ=dict(env)).load()

    where = env.get(CONTAINER_TOKEN_FILE, "no token file")
    source = f"EKS Pod Identity at {env[CONTAINER_URI]}, token {where}"
    return StoreAccess(Identity("eks-pod-identity", source), load)


def _from_env(env: Mapping[str, str]) -> StoreAccess:
    async def load(session: AioSession) -> Any:
        return await AioEnvProvider(environ=dict(env)).load()

    return StoreAccess(Identity("environment", "AWS_ACCESS_KEY_ID in the environment"), load)


def resolve(
    secret_dir: Path | None, env: Mapping[str, str], sts_duration: int | None = None
) -> StoreAccess:
    """The sidecar's one source of store credentials, in the order the webhook means them."""
    if secret_dir is not None:
        return _from_secret(secret_dir)
    if env.get(ROLE_ARN) and env.get(TOKEN_FILE):
        return _from_irsa(env, sts_duration)
    if env.get(CONTAINER_URI):
        return _from_pod_identity(env)
    if env.get(ACCESS_KEY) and env.get(SECRET_KEY):
        return _from_env(env)
    raise CredentialsError(
        "no credentials for the store: no s3-secret (jitckpt.io/s3-secret), no pod "
        "identity (IRSA's AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE, or EKS Pod "
        "Identity's AWS_CONTAINER_CREDENTIALS_FULL_URI) and no keys in the environment; "
        "the node's instance role is never used"
    )

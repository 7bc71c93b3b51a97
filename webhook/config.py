"""The webhook's configuration file (a ConfigMap in the cluster).

Cluster-wide defaults for the settings of ``webhook/settings.py`` sit under
``defaults:`` (names without the ``jitckpt.io/`` prefix); the other keys say
how to inject. The file is checked completely when it is loaded, so a typo
stops the server at start instead of silently changing what pods get.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from webhook import images, settings

VERSION = version("jitckpt")
# Pinned: the webhook and the sidecar it injects are released together.
DEFAULT_SIDECAR_IMAGE = f"ghcr.io/jitckpt/jitckpt-sidecar:{VERSION}"
DEFAULT_WEBHOOK_NAMESPACE = "jitckpt-system"


class ConfigError(ValueError):
    """The configuration file cannot be used; the message says why and where."""


class WebhookConfig(BaseModel):
    """What the webhook injects, beyond the per-namespace and per-pod settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    defaults: dict[str, str] = Field(default_factory=dict)
    sidecar_image: str = DEFAULT_SIDECAR_IMAGE
    sidecar_image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # The sidecar's non-root user and group (the image's own user).
    sidecar_user_id: int = Field(default=65532, ge=1, le=2**31 - 1)
    webhook_namespace: str = DEFAULT_WEBHOOK_NAMESPACE
    invalid_setting_policy: Literal["admit", "deny"] = "admit"
    # Whether any pod may set jitckpt.io/verify-ssl: "false" (a store with a self-signed
    # certificate); forbidden by default: checkpoints would travel unauthenticated.
    allow_insecure_tls: bool = False
    # An identity webhook (IRSA's, EKS Pod Identity's) mutates pods after this one: a pod
    # with neither an s3-secret nor an identity on its trainer is then not marked
    # no-credentials at admission (the sidecar still says so if it cannot reach the store).
    identity_webhook: bool = False

    @field_validator("defaults", mode="before")
    @classmethod
    def _stringify(cls, value: Any) -> Any:
        """YAML writes ``600`` and ``false`` unquoted; annotations are strings."""
        if not isinstance(value, dict):
            return value
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if isinstance(item, bool):
                out[key] = "true" if item else "false"
            elif isinstance(item, int | float):
                out[key] = str(item)
            else:
                out[key] = item
        return out

    @field_validator("defaults")
    @classmethod
    def _known_and_valid(cls, value: dict[str, str]) -> dict[str, str]:
        problems = []
        for name, item in value.items():
            if name not in settings.SETTINGS:
                known = ", ".join(sorted(settings.SETTINGS))
                problems.append(f"unknown setting {name!r} in defaults (known: {known})")
                continue
            error = settings.validate_value(name, item, "cluster defaults")
            if error is not None:
                problems.append(str(error))
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _tls_defaults_allowed(self) -> WebhookConfig:
        if self.defaults.get("verify-ssl") == "false" and not self.allow_insecure_tls:
            raise ValueError(
                "defaults.verify-ssl is false while allow_insecure_tls is false: set "
                "allow_insecure_tls: true to let pods turn off the store's TLS checks"
            )
        return self

    @field_validator("sidecar_image")
    @classmethod
    def _reference(cls, value: str) -> str:
        """A tag or, as the shipped config does, a digest (``name@sha256:...``, immutable)."""
        if images.parse(value) is None:
            raise ValueError(f"sidecar_image {images.REFERENCE_RULE}")
        return value


def load_config(path: Path | None) -> WebhookConfig:
    """Read the YAML file at ``path``; ``None`` gives the built-in defaults."""
    return WebhookConfig() if path is None else read_config(path)[0]


def read_config(path: Path) -> tuple[WebhookConfig, str]:
    """The configuration in the file at ``path`` and a digest of the bytes it was read from
    (one read: a file swapped meanwhile cannot give one's digest to the other's content)."""
    import hashlib

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid UTF-8") from None
    return parse_config(text, path), hashlib.sha256(data).hexdigest()[:16]


def parse_config(text: str, path: Path) -> WebhookConfig:
    """The configuration ``text`` (read from ``path``, which errors name) says."""
    import yaml

    from webhook import safeyaml

    try:
        data = safeyaml.load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        return WebhookConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            message = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{where}: {message}")
        raise ConfigError(f"{path}: " + "; ".join(lines)) from None

"""Every ``jitckpt.io/*`` setting a user can write: key, default, validation rule.

This module is the one answer to "what can a user set?". The webhook, the
offline injector, the audit and the config loader all read it, so a new
setting is added here once. A value is checked against its rule before
anything is injected: an invalid value never yields a half-injected pod.

Precedence (lowest first): built-in default < cluster default (the config
file's ``defaults:``) < namespace annotation < pod annotation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from jitckpt import destination as grammar
from jitckpt.destination import is_dns1123_subdomain

PREFIX = "jitckpt.io/"
INJECTION_LABEL = PREFIX + "injection"  # namespace label; "enabled" opts the namespace in
INJECTION_ENABLED = "enabled"
INJECT_KEY = PREFIX + "inject"  # pod label or annotation; "false" opts one job out
STATUS_KEY = PREFIX + "status"  # written by the webhook: what it injected
# Written by the webhook: "<reason>: <sentence>", why a pod was not injected (the skip
# reason, as the metrics spell it) or why an injected one may run unprotected.
REASON_KEY = PREFIX + "reason"

# Sources of a resolved value, lowest precedence first.
SOURCE_BUILTIN = "builtin"
SOURCE_CLUSTER = "cluster"
SOURCE_NAMESPACE = "namespace"
SOURCE_POD = "pod"

Check = Callable[[str], bool]


@dataclass(frozen=True)
class Setting:
    """One annotation: its name without the prefix, default and rule."""

    name: str
    default: str | None  # None: unset unless a user sets it
    rule: str  # the rule in words, quoted in every error
    check: Check
    help: str

    @property
    def key(self) -> str:
        return PREFIX + self.name


@dataclass(frozen=True)
class SettingError:
    """A value that breaks its setting's rule (or a key no setting has)."""

    key: str
    value: str
    rule: str
    source: str

    def __str__(self) -> str:
        return f'{self.key}="{self.value}" (from {self.source}) is invalid: {self.rule}'


@dataclass(frozen=True)
class Resolution:
    """Settings after precedence: values (set ones only), where each came from, errors."""

    values: dict[str, str]
    sources: dict[str, str]
    errors: list[SettingError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# --- value rules -----------------------------------------------------------

# Kubernetes resource.Quantity: a signed decimal number and an optional suffix.
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(\d+(\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BOOLEANS = ("true", "false")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
SIDECAR_MODES = ("native", "legacy")
# What a sidecar that cannot reach the store does: let the trainer run unprotected (and
# say so), or hold it (fail closed: the pod never starts training).
RUN_UNPROTECTED = "run-unprotected"
FAIL_CLOSED = "fail-closed"
STORE_UNREACHABLE = (RUN_UNPROTECTED, FAIL_CLOSED)
INT32_MAX = 2**31 - 1


def parse_quantity(value: str) -> Decimal | None:
    """The numeric value of a Kubernetes quantity, or None if it is not one."""
    match = _QUANTITY.match(value)
    if not match:
        return None
    try:
        number = Decimal(match.group("number"))
    except InvalidOperation:
        return None
    suffix = match.group("suffix") or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(suffix[1:]))


def is_positive_quantity(value: str) -> bool:
    quantity = parse_quantity(value)
    return quantity is not None and quantity > 0


PIECE_MIN_SIZE = 64 * 1024  # the smallest piece-min-size: below, requests cost more than bytes


def piece_bytes(value: str) -> int | None:
    """``value`` (a Kubernetes quantity) as a whole number of bytes of at least
    PIECE_MIN_SIZE, or None."""
    quantity = parse_quantity(value)
    if quantity is None or quantity != quantity.to_integral_value() or quantity < PIECE_MIN_SIZE:
        return None
    return int(quantity)


def _int_range(low: int, high: int) -> Check:
    def check(value: str) -> bool:
        if not re.fullmatch(r"[0-9]+", value):
            return False
        return low <= int(value) <= high

    return check


def _one_of(choices: tuple[str, ...]) -> Check:
    return lambda value: value in choices


# --- the table of DESIGN section 2 ------------------------------------------

_SETTINGS = (
    Setting(
        "destination",
        None,
        grammar.RULE,
        grammar.is_destination,
        "where checkpoints go; the job root is <destination>/<namespace>/<job>",
    ),
    Setting(
        "s3-secret",
        None,
        "must be a Secret name (DNS-1123 subdomain, at most 253 characters)",
        is_dns1123_subdomain,
        "Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_S3_ENDPOINT, "
        "AWS_DEFAULT_REGION; given to the sidecar only",
    ),
    Setting(
        "grace-period-seconds",
        "300",
        "must be an integer from 10 to 86400",
        _int_range(10, 86400),
        "pod terminationGracePeriodSeconds (never lowers a larger value)",
    ),
    Setting(
        "save-strategy",
        None,
        "must be one of " + ", ".join(SAVE_STRATEGIES),
        _one_of(SAVE_STRATEGIES),
        "HF TrainingArguments.save_strategy",
    ),
    Setting(
        "save-steps",
        None,
        f"must be an integer from 1 to {INT32_MAX}",
        _int_range(1, INT32_MAX),
        "HF TrainingArguments.save_steps",
    ),
    Setting(
        "save-total-limit",
        None,
        "must be an integer from 1 to 100000",
        _int_range(1, 100000),
        "HF TrainingArguments.save_total_limit",
    ),
    Setting("jit", "true", "must be true or false", _one_of(BOOLEANS), "save on SIGTERM"),
    Setting(
        "s3-retention",
        "0",
        "must be an integer from 0 to 100000 (0 keeps all)",
        _int_range(0, 100000),
        "keep the newest N valid checkpoints in the store",
    ),
    Setting("verify-ssl", "true", "must be true or false", _one_of(BOOLEANS), "TLS checks"),
    Setting(
        "verify-access",
        "true",
        "must be true or false",
        _one_of(BOOLEANS),
        "probe the destination before training starts",
    ),
    Setting(
        "local-size-limit",
        None,
        "must be a positive Kubernetes quantity (like 100Gi)",
        is_positive_quantity,
        "sizeLimit of the local staging emptyDir",
    ),
    Setting(
        "sidecar-cpu",
        "250m",
        "must be a positive Kubernetes quantity (like 250m or 1)",
        is_positive_quantity,
        "sidecar CPU request and limit",
    ),
    Setting(
        "sidecar-memory",
        "512Mi",
        "must be a positive Kubernetes quantity (like 512Mi)",
        is_positive_quantity,
        "sidecar memory request and limit",
    ),
    Setting(
        "resume",
        "true",
        "must be true or false",
        _one_of(BOOLEANS),
        "false starts fresh even when checkpoints exist",
    ),
    Setting(
        "sidecar-mode",
        "native",
        "must be one of " + ", ".join(SIDECAR_MODES),
        _one_of(SIDECAR_MODES),
        "native sidecar (Kubernetes 1.29+) or legacy init container + container",
    ),
    Setting(
        "piece-min-size",
        None,
        "must be a whole number of bytes of at least 64Ki, as a Kubernetes quantity (like 64Mi)",
        lambda value: piece_bytes(value) is not None,
        "smallest piece of a replicated file each node uploads of a checkpoint every node wrote",
    ),
    Setting(
        "upload-final",
        "true",
        "must be true or false",
        _one_of(BOOLEANS),
        "at a normal end of training, upload the model the program saved to <job root>/final/",
    ),
    Setting(
        "store-unreachable",
        RUN_UNPROTECTED,
        "must be one of " + ", ".join(STORE_UNREACHABLE),
        _one_of(STORE_UNREACHABLE),
        "a sidecar that cannot reach the store lets the trainer run unprotected, or "
        "(fail-closed) never lets it start",
    ),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _SETTINGS}
# jitckpt.io/* keys that are not settings but are known.
RESERVED_KEYS = (INJECT_KEY, STATUS_KEY, REASON_KEY, INJECTION_LABEL)


# Applies to every setting before its own rule: each value ends up in an env
# var of the sidecar or the trainer, where the kubelet expands $(VAR) (the
# sidecar's env holds the S3 Secret, so a value could copy it into keys, logs
# and /status).
NO_ENV_EXPANSION_RULE = (
    f"must not contain '{grammar.ENV_EXPANSION}' (the kubelet expands $(VAR) in env values)"
)


def validate_value(name: str, value: str, source: str) -> SettingError | None:
    """The error for ``value`` of setting ``name``, or None when it is valid."""
    setting = SETTINGS.get(name)
    if setting is None:
        return SettingError(PREFIX + name, value, "no such setting", source)
    if grammar.ENV_EXPANSION in value:
        return SettingError(setting.key, value, NO_ENV_EXPANSION_RULE, source)
    if setting.check(value):
        return None
    return SettingError(setting.key, value, setting.rule, source)


def _from_annotations(annotations: Mapping[str, str], source: str, out: Resolution) -> None:
    """Take the ``jitckpt.io/*`` settings of ``annotations`` (of the pod or namespace)."""
    where = f"{source} annotation"
    for key, value in annotations.items():
        if not isinstance(key, str) or not key.startswith(PREFIX) or key in RESERVED_KEYS:
            continue
        name = key[len(PREFIX) :]
        if name not in SETTINGS:
            out.warnings.append(f"unknown annotation {key} (from {where}) is ignored")
            continue
        text = value if isinstance(value, str) else str(value)
        error = validate_value(name, text, where)
        if error is not None:
            out.errors.append(error)
            continue
        out.values[name] = text
        out.sources[name] = source


# The webhook config's switch ``allow_insecure_tls`` (webhook/config.py) over ``verify-ssl``.
INSECURE_TLS_RULE = (
    "must be true: this cluster's webhook configuration forbids turning off the store's "
    "TLS certificate checks (allow_insecure_tls: false)"
)
_SOURCE_WORDS = {
    SOURCE_CLUSTER: "cluster defaults",
    SOURCE_NAMESPACE: "namespace annotation",
    SOURCE_POD: "pod annotation",
}


def _tls_policy(out: Resolution, allow_insecure_tls: bool) -> None:
    """``verify-ssl=false``: an error where the cluster forbids it, else a warning."""
    if out.values.get("verify-ssl") != "false":
        return
    source = _SOURCE_WORDS.get(out.sources["verify-ssl"], out.sources["verify-ssl"])
    key = SETTINGS["verify-ssl"].key
    if not allow_insecure_tls:
        out.errors.append(SettingError(key, "false", INSECURE_TLS_RULE, source))
        return
    out.warnings.append(
        f'{key}="false" (from {source}): the sidecar does not check the store\'s TLS '
        "certificate, so anyone on the network path to the store can read and change "
        "checkpoints"
    )


def resolve(
    cluster_defaults: Mapping[str, str],
    namespace_annotations: Mapping[str, str],
    pod_annotations: Mapping[str, str],
    *,
    allow_insecure_tls: bool,
) -> Resolution:
    """Apply precedence and validate every value that takes part.

    ``allow_insecure_tls`` is the cluster's say over ``verify-ssl=false``.
    """
    out = Resolution(values={}, sources={})
    for setting in _SETTINGS:
        if setting.default is not None:
            out.values[setting.name] = setting.default
            out.sources[setting.name] = SOURCE_BUILTIN
    for name, value in cluster_defaults.items():
        error = validate_value(name, value, "cluster defaults")
        if error is not None:
            out.errors.append(error)
            continue
        out.values[name] = value
        out.sources[name] = SOURCE_CLUSTER
    _from_annotations(namespace_annotations, SOURCE_NAMESPACE, out)
    _from_annotations(pod_annotations, SOURCE_POD, out)
    _tls_policy(out, allow_insecure_tls)
    return out


def validate_opt_out(value: str, source: str) -> SettingError | None:
    """``jitckpt.io/inject`` accepts only the two booleans."""
    if value in BOOLEANS:
        return None
    return SettingError(INJECT_KEY, value, "must be true or false", source)

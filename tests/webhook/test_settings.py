"""The settings table: rules, precedence, and the config file that sets cluster defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from webhook import settings
from webhook.config import ConfigError, WebhookConfig, load_config


@pytest.mark.parametrize(
    "value",
    [
        "s3://ml-checkpoints",
        "s3://ml-checkpoints/",
        "s3://ml.checkpoints-1/team-a/runs/",
        "pvc://shared-ckpt",
        "pvc://shared-ckpt/jobs/x",
    ],
)
def test_valid_destinations(value: str) -> None:
    assert settings.validate_value("destination", value, "pod") is None


@pytest.mark.parametrize(
    "value",
    [
        "s3://Bucket/x",  # upper case
        "s3://ab",  # too short
        "s3://-bucket",
        "s3://bucket-",
        "s3://my..bucket",
        "s3://192.168.1.10",
        "s3://xn--bucket",
        "s3://bucket/../other",
        "s3://bucket/a/../../b",
        "s3://bucket//absolute",
        "s3://bucket/a//b",
        "s3://bucket/./a",
        "pvc://Claim_1/x",
        "pvc://claim/../x",
        "pvc:///abs",
        "gs://bucket/x",
        "bucket/x",
        "",
    ],
)
def test_invalid_destinations_name_key_and_rule(value: str) -> None:
    error = settings.validate_value("destination", value, "pod annotation")
    assert error is not None
    text = str(error)
    assert text.startswith("jitckpt.io/destination=")
    assert "bucket name" in text and "'..'" in text and "pod annotation" in text


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("grace-period-seconds", ["10", "600", "86400"], ["9", "86401", "-1", "1.5", "ten", ""]),
        ("save-steps", ["1", "500"], ["0", "-5", "1e3", "2147483648"]),
        ("save-total-limit", ["1", "3"], ["0", "x"]),
        ("s3-retention", ["0", "5"], ["-1", "five"]),
        ("save-strategy", ["no", "steps", "epoch", "best"], ["Steps", "always"]),
        ("jit", ["true", "false"], ["True", "yes", "1"]),
        ("verify-ssl", ["true", "false"], ["no"]),
        ("resume", ["false"], ["0"]),
        ("sidecar-mode", ["native", "legacy"], ["sidecar"]),
        ("local-size-limit", ["100Gi", "5e9", "1.5Ti", "500M"], ["0", "-1Gi", "10GB", "1.5.3Gi"]),
        ("sidecar-cpu", ["250m", "1", "0.5"], ["0m", "1 cpu", "m"]),
        ("sidecar-memory", ["512Mi", "1G"], ["512 MiB", "0Mi"]),
        ("s3-secret", ["team-a-s3", "a.b"], ["Team_A", "-x", "a" * 254]),
    ],
)
def test_rules(name: str, good: list[str], bad: list[str]) -> None:
    for value in good:
        assert settings.validate_value(name, value, "pod") is None, value
    for value in bad:
        error = settings.validate_value(name, value, "pod")
        assert error is not None, value
        assert error.key == "jitckpt.io/" + name
        assert error.rule == settings.SETTINGS[name].rule


def test_quantity_values() -> None:
    assert settings.parse_quantity("1Gi") == 2**30
    assert settings.parse_quantity("250m") == settings.parse_quantity("0.25")
    assert settings.parse_quantity("1e3") == 1000
    assert settings.parse_quantity("1GB") is None


def test_precedence_cluster_namespace_pod() -> None:
    cluster = {"destination": "s3://cluster-bucket", "s3-retention": "1", "jit": "false"}
    namespace = {"jitckpt.io/destination": "s3://ns-bucket", "jitckpt.io/s3-retention": "2"}
    pod = {"jitckpt.io/s3-retention": "3", "other.io/x": "y"}
    result = settings.resolve(cluster, namespace, pod, allow_insecure_tls=False)
    assert result.errors == []
    assert result.values["destination"] == "s3://ns-bucket"
    assert result.sources["destination"] == "namespace"
    assert result.values["s3-retention"] == "3"
    assert result.sources["s3-retention"] == "pod"
    assert result.values["jit"] == "false"
    assert result.sources["jit"] == "cluster"
    assert result.values["grace-period-seconds"] == "300"
    assert result.sources["grace-period-seconds"] == "builtin"
    assert "save-steps" not in result.values


def test_resolve_reports_every_invalid_value_and_warns_on_unknown_keys() -> None:
    result = settings.resolve(
        {},
        {"jitckpt.io/save-steps": "zero"},
        {"jitckpt.io/grace-period-seconds": "5", "jitckpt.io/destinaton": "s3://x"},
        allow_insecure_tls=False,
    )
    assert {e.key for e in result.errors} == {
        "jitckpt.io/save-steps",
        "jitckpt.io/grace-period-seconds",
    }
    assert any("jitckpt.io/destinaton" in w for w in result.warnings)


def test_load_config_defaults_without_file() -> None:
    config = load_config(None)
    assert config == WebhookConfig()
    assert ":" in config.sidecar_image.rsplit("/", 1)[-1]  # a pinned tag
    assert config.invalid_setting_policy == "admit"


def test_load_config_reads_yaml_and_stringifies(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "defaults:\n  destination: s3://ckpt\n  grace-period-seconds: 900\n  jit: false\n"
        "invalid_setting_policy: deny\nwebhook_namespace: ckpt-system\n"
    )
    config = load_config(path)
    assert config.defaults == {
        "destination": "s3://ckpt",
        "grace-period-seconds": "900",
        "jit": "false",
    }
    assert config.invalid_setting_policy == "deny"
    assert config.webhook_namespace == "ckpt-system"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("defaults:\n  destinaton: s3://x\n", "unknown setting 'destinaton' in defaults"),
        ("defaults:\n  save-steps: 0\n", "jitckpt.io/save-steps"),
        ("sidecarImage: x\n", "sidecarImage"),
        ("invalid_setting_policy: maybe\n", "invalid_setting_policy"),
        ("- a\n- b\n", "mapping"),
        ("defaults: [\n", "not valid YAML"),
    ],
)
def test_load_config_rejects_bad_files(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name", sorted(settings.SETTINGS))
@pytest.mark.parametrize(
    "value", ["$(AWS_SECRET_ACCESS_KEY)", "s3://ml-checkpoints/$(HOME)", "1$("]
)
def test_no_setting_may_carry_an_env_expansion(name: str, value: str) -> None:
    """The kubelet expands $(VAR) in env values: every value that could reach env is refused."""
    error = settings.validate_value(name, value, "pod annotation")
    assert error is not None
    assert error.rule == settings.NO_ENV_EXPANSION_RULE
    assert error.key == settings.PREFIX + name


def test_env_expansion_in_cluster_defaults_stops_the_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("defaults:\n  destination: s3://ml-checkpoints/$(AWS_SECRET_ACCESS_KEY)\n")
    with pytest.raises(ConfigError, match=r"must not contain '\$\('"):
        load_config(path)


@pytest.mark.parametrize(
    ("cluster", "namespace", "pod", "source"),
    [
        ({}, {}, {"jitckpt.io/verify-ssl": "false"}, "pod annotation"),
        ({}, {"jitckpt.io/verify-ssl": "false"}, {}, "namespace annotation"),
        ({"verify-ssl": "false"}, {}, {}, "cluster defaults"),
    ],
)
def test_verify_ssl_false_is_forbidden_unless_the_cluster_allows_it(
    cluster: dict[str, str], namespace: dict[str, str], pod: dict[str, str], source: str
) -> None:
    forbidden = settings.resolve(cluster, namespace, pod, allow_insecure_tls=False)
    (error,) = forbidden.errors
    assert (error.key, error.rule, error.source) == (
        "jitckpt.io/verify-ssl",
        settings.INSECURE_TLS_RULE,
        source,
    )
    allowed = settings.resolve(cluster, namespace, pod, allow_insecure_tls=True)
    assert allowed.errors == [] and allowed.values["verify-ssl"] == "false"
    (warning,) = allowed.warnings
    assert f"(from {source})" in warning and "TLS certificate" in warning
    # verify-ssl=true (or the default) is neither an error nor a warning.
    plain = settings.resolve({}, {}, {"jitckpt.io/verify-ssl": "true"}, allow_insecure_tls=False)
    assert plain.errors == [] and plain.warnings == []


def test_a_config_cannot_default_to_insecure_tls_without_allowing_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("defaults:\n  verify-ssl: false\n")
    with pytest.raises(ConfigError, match="allow_insecure_tls"):
        load_config(path)
    path.write_text("defaults:\n  verify-ssl: false\nallow_insecure_tls: true\n")
    assert load_config(path).allow_insecure_tls is True
    assert WebhookConfig().allow_insecure_tls is False

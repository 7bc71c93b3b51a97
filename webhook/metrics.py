"""Prometheus metrics of the admission server.

Each app owns its own ``CollectorRegistry`` (no process-global default
registry), so tests can build many apps in one process and read exact counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Admission must answer within the webhook's timeoutSeconds (10 s); the
# interesting range is sub-millisecond to a second.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class AdmissionMetrics:
    """The counters and histogram named in the design, in one registry."""

    registry: CollectorRegistry
    requests: Counter
    injected: Counter
    skipped: Counter
    denied: Counter
    failed: Counter
    latency: Histogram
    config_reloads: Counter

    @classmethod
    def create(cls) -> AdmissionMetrics:
        registry = CollectorRegistry()
        return cls(
            registry=registry,
            requests=Counter(
                "jitckpt_webhook_requests",
                "AdmissionReview requests received on /mutate.",
                registry=registry,
            ),
            injected=Counter(
                "jitckpt_webhook_injected", "Pods that got the sidecar.", registry=registry
            ),
            skipped=Counter(
                "jitckpt_webhook_skipped",
                "Pods admitted unchanged, by reason.",
                ["reason"],
                registry=registry,
            ),
            denied=Counter(
                "jitckpt_webhook_denied",
                "Pods denied because of an invalid setting (invalid_setting_policy: deny).",
                registry=registry,
            ),
            failed=Counter(
                "jitckpt_webhook_failed",
                "Requests that could not be processed (malformed, too large, internal error).",
                ["reason"],
                registry=registry,
            ),
            latency=Histogram(
                "jitckpt_webhook_request_duration_seconds",
                "Time from the request's arrival to the answer, for /mutate.",
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            config_reloads=Counter(
                "jitckpt_webhook_config_reloads",
                "Changes of the config file read while serving, by result (ok, or invalid: "
                "the previous configuration stays in use).",
                ["result"],
                registry=registry,
            ),
        )

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

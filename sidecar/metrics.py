"""Prometheus metrics of one sidecar, in their own registry (served at ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.committed = Counter(
            "jitckpt_checkpoints_committed", "Checkpoints this node committed", ["kind"], registry=r
        )
        self.last_committed_step = Gauge(
            "jitckpt_last_committed_step", "Step of the newest committed checkpoint", registry=r
        )
        self.upload_bytes = Counter(
            "jitckpt_upload_bytes", "Bytes uploaded to the checkpoint store", registry=r
        )
        self.upload_seconds = Histogram(
            "jitckpt_upload_seconds",
            "Time to upload and commit one checkpoint",
            ["kind"],
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.upload_failures = Counter(
            "jitckpt_upload_failures", "Upload attempts that failed and were re-queued", registry=r
        )
        self.store_retries = Counter(
            "jitckpt_store_retries", "Store requests retried after a transient error", registry=r
        )
        self.dropped = Counter(
            "jitckpt_checkpoints_dropped",
            "Staged checkpoints dropped unuploaded: a newer one superseded them",
            registry=r,
        )
        self.queue_length = Gauge(
            "jitckpt_upload_queue_length", "Staged checkpoints not yet committed", registry=r
        )
        self.restored_step = Gauge(
            "jitckpt_restored_step", "Step restored at start (-1: none)", registry=r
        )
        self.restore_seconds = Gauge(
            "jitckpt_restore_seconds", "Time the restore at start took", registry=r
        )
        self.restore_downloaded = Counter(
            "jitckpt_restore_downloaded_bytes",
            "Bytes this pod's restores fetched (a copy already in place costs none)",
            registry=r,
        )
        self.torn_skipped = Counter(
            "jitckpt_restore_torn_skipped", "Torn checkpoints skipped by the restore", registry=r
        )
        self.retention_deleted = Counter(
            "jitckpt_retention_deleted", "Checkpoints deleted by retention", registry=r
        )
        self.training_step = Gauge(
            "jitckpt_training_step", "Last step the trainer reported", registry=r
        )
        self.ready = Gauge("jitckpt_ready", "1 once the trainer may start", registry=r)
        self.unprotected = Gauge(
            "jitckpt_unprotected",
            "1 when the store cannot be reached and the trainer runs without checkpoints",
            registry=r,
        )
        self.grace_short_by = Gauge(
            "jitckpt_grace_short_by_seconds",
            "How much the grace period lacks for the measured checkpoint (0: enough)",
            registry=r,
        )
        self.restored_step.set(-1)

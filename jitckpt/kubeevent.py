"""The body of a Kubernetes Event (core v1), as the webhook and the sidecar post them.

Both post Events about one object each time (the webhook on a job, the sidecar on its
own pod); what differs is the object, the reason, the type and who reports. Standard
library only: the kubernetes client takes the body as a plain mapping.
"""

from __future__ import annotations

from datetime import UTC, datetime

MAX_MESSAGE = 1024


def event_body(
    involved: dict[str, str], reason: str, message: str, *, kind: str, component: str, instance: str
) -> dict[str, object]:
    """An Event about ``involved`` (its apiVersion, kind, name, namespace, uid if known)."""
    now = datetime.now(UTC).isoformat()
    return {
        "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": kind,
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }

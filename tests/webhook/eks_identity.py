"""What EKS's identity webhooks do to a pod, for tests that run them before or after ours.

Both add the same env and a projected token volume to every container and init
container (the sidecar too, when they run after this webhook), leaving a
container alone where the env is already set or the path already mounted.
Modelled on aws/amazon-eks-pod-identity-webhook ``pkg/handler/handler.go``
(IRSA) and the EKS Pod Identity webhook's documented mutation.
"""

from __future__ import annotations

import copy
from typing import Any

IRSA_ROLE = "arn:aws:iam::123456789012:role/team-a-training"
IRSA_DIR = "/var/run/secrets/eks.amazonaws.com/serviceaccount"
POD_IDENTITY_DIR = "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount"


def _token_volume(name: str, audience: str, path: str) -> dict[str, Any]:
    token = {"audience": audience, "expirationSeconds": 86400, "path": path}
    return {"name": name, "projected": {"sources": [{"serviceAccountToken": token}]}}


KINDS: dict[str, tuple[list[dict[str, Any]], dict[str, Any], str]] = {
    "irsa": (
        [
            {"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"},
            {"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"},
            {"name": "AWS_REGION", "value": "eu-west-1"},
            {"name": "AWS_ROLE_ARN", "value": IRSA_ROLE},
            {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": f"{IRSA_DIR}/token"},
        ],
        _token_volume("aws-iam-token", "sts.amazonaws.com", "token"),
        IRSA_DIR,
    ),
    "eks-pod-identity": (
        [
            {
                "name": "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "value": "http://169.254.170.23/v1/credentials",
            },
            {
                "name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                "value": f"{POD_IDENTITY_DIR}/eks-pod-identity-token",
            },
        ],
        _token_volume("eks-pod-identity-token", "pods.eks.amazonaws.com", "eks-pod-identity-token"),
        POD_IDENTITY_DIR,
    ),
}


def apply(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    """``pod`` as the identity webhook of ``kind`` returns it (a new pod)."""
    env, volume, mount_path = KINDS[kind]
    out = copy.deepcopy(pod)
    spec = out["spec"]
    volumes = spec.setdefault("volumes", [])
    if all(v.get("name") != volume["name"] for v in volumes):
        volumes.append(copy.deepcopy(volume))
    for container in spec.get("initContainers", []) + spec["containers"]:
        have = {e.get("name") for e in container.get("env") or []}
        if have & {e["name"] for e in env[-2:]}:
            continue  # already configured: the webhook leaves such a container alone
        added = [copy.deepcopy(e) for e in env if e["name"] not in have]
        container.setdefault("env", []).extend(added)
        mounts = container.setdefault("volumeMounts", [])
        if all(m.get("mountPath") != mount_path for m in mounts):
            mounts.append({"name": volume["name"], "mountPath": mount_path, "readOnly": True})
    return out

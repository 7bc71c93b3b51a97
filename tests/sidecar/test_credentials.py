"""The sidecar's store credentials against a store that checks them.

For the Secret, the S3 server enforces IAM (moto's auth after ``reset-auth``):
a key it does not know, or one deleted, is refused. So a sidecar that kept a
rotated-out key, or fell back to any other identity, fails its uploads.

- The s3-secret as files, rotated the way the kubelet does it (a new version,
  one swap of ``..data``), then the old key deleted: the running agent goes on
  uploading with the new key, without a restart.
- IRSA: the agent exchanges the pod's web identity token at STS
  (AssumeRoleWithWebIdentity) and asks again before the short-lived keys expire.
- EKS Pod Identity: keys from the agent's endpoint, asked for with the pod's token.
- Nothing to use: a clear refusal at start, never the node's role.
Each says in its log and ``/status`` which identity it uses and where from.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest

from local.podrunner.volumes import write_secret_volume
from local.s3server import ACCESS_KEY, REGION, SECRET_KEY, LocalS3
from shim import layout, protocol
from shim.channel import Client
from tests.sidecar import shimtalk
from tests.sidecar.agentproc import AgentProcess
from tests.sidecar.helpers import stage
from tests.support.faultproxy import FaultProxy
from tests.support.iamstore import IamStore

TRUST = json.dumps(
    {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Federated": "oidc.eks.example/id/TEST"},
                "Action": "sts:AssumeRoleWithWebIdentity",
            }
        ],
    }
)
STS_SECONDS = 30  # the agent asks for new keys when half of this is left


@pytest.fixture
def store() -> Iterator[IamStore]:
    """A server of its own: once auth is on, it is on for every client of it."""
    with LocalS3() as server:
        yield IamStore(server)


def upload(agent: AgentProcess, client: Client, step: int) -> None:
    directory, files = stage(agent.staging, f"checkpoint-{step}-periodic-1", {"w.bin": 4096})
    answer = client.call(shimtalk.staged(step, "periodic", directory, files))
    assert isinstance(answer, protocol.StagedAnswer), answer
    agent.wait_for(lambda: agent.committed_step() == step, 60, f"checkpoint-{step} committed")


def test_a_rotated_secret_is_used_without_a_restart(store: IamStore, tmp_path: Path) -> None:
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    first = store.new_key()
    write_secret_volume(secret_dir, store.data_connection(first), None)
    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{store.bucket}/ns-a/job-1",
        s3_env={},  # no key, no endpoint in the env: all of it comes from the files
        extra_env={layout.ENV_S3_SECRET_DIR: str(secret_dir)},
    )
    try:
        agent.start()
        agent.wait_ready()
        assert agent.status()["identity"] == {
            "kind": "s3-secret",
            "source": f"files of the s3-secret at {secret_dir}",
        }
        client = Client(str(agent.socket))
        client.call(shimtalk.hello(4242))
        upload(agent, client, 10)

        second = store.new_key()
        write_secret_volume(secret_dir, store.data_connection(second), None)  # the kubelet's swap
        store.iam.delete_access_key(UserName="trainer", AccessKeyId=first[0])
        assert not store.accepts(first) and store.accepts(second)
        upload(agent, client, 20)
        upload(agent, client, 30)
        client.close()
        assert agent.terminate() == 0
    finally:
        agent.kill()
    log = agent.log()
    assert "store credentials: s3-secret" in log and "changed: using the new version" in log
    for key in (first, second):
        assert key[0] not in log and key[1] not in log


@pytest.fixture
def own_s3() -> Iterator[LocalS3]:
    """A server of this test's own: moto's model dump (which keys STS issued) walks every
    object the server holds, and the shared server's, left by other tests, can break it."""
    with LocalS3() as server:
        yield server


def test_irsa_assumes_the_pods_role_and_refreshes_before_expiry(
    own_s3: LocalS3, tmp_path: Path
) -> None:
    """moto's STS answers AssumeRoleWithWebIdentity, which is unsigned, only while its IAM
    checks are off: here the proxy in front of S3 records which key signed each request,
    and every one must be a key STS issued for the pod's role, a new one in use before
    the first expired."""
    local_s3, bucket = own_s3, f"ckpt-{uuid.uuid4().hex[:12]}"
    own_s3.create_bucket(bucket)
    with FaultProxy(own_s3.endpoint) as proxy:
        _irsa_refreshes(local_s3, bucket, proxy, tmp_path)


def _irsa_refreshes(local_s3: LocalS3, bucket: str, proxy: FaultProxy, tmp_path: Path) -> None:
    admin = boto3.client(
        "iam",
        endpoint_url=local_s3.endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    role = admin.create_role(RoleName=f"training-{bucket}", AssumeRolePolicyDocument=TRUST)
    role_arn = role["Role"]["Arn"]
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.test-web-identity-token")
    agent = AgentProcess(
        root=tmp_path,
        destination=f"s3://{bucket}/ns-a/job-1",
        s3_env={
            "AWS_ROLE_ARN": role_arn,
            "AWS_WEB_IDENTITY_TOKEN_FILE": str(token),
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_S3_ENDPOINT": proxy.endpoint,
            "AWS_ENDPOINT_URL_STS": proxy.endpoint,  # its requests timed by the proxy
        },
        extra_env={"JITCKPT_STS_DURATION_SECONDS": str(STS_SECONDS)},
    )

    def keys_used() -> list[str]:
        return list(dict.fromkeys(r.access_key for r in proxy.requests if r.access_key))

    started = time.monotonic()
    try:
        agent.start()
        agent.wait_ready()
        identity = agent.status()["identity"]
        assert identity == {
            "kind": "irsa",
            "source": f"role {role_arn} (IRSA), web identity token {token}",
        }
        client = Client(str(agent.socket))
        client.call(shimtalk.hello(4242))
        # Keep uploading until the agent uses new keys: before the first ones expire.
        step = 0
        while len(keys_used()) < 2:
            step += 10
            upload(agent, client, step)
            assert time.monotonic() - started < 4 * STS_SECONDS, "no new keys"
            time.sleep(1)
        upload(agent, client, step + 10)  # and the new keys work
        client.close()
        assert agent.terminate() == 0
    finally:
        agent.kill()
    # STS issued the first keys after it was asked (the first POST to /, which S3 is never
    # sent here): they expired STS_SECONDS after that at the earliest, however long the
    # agent took to start.
    asked = [r.time for r in proxy.requests if r.method == "POST" and r.target == "/"]
    renewed = next(r.time for r in proxy.requests if r.access_key == keys_used()[1])
    assert len(asked) >= 2 and renewed < asked[0] + STS_SECONDS, "new keys after the old expired"
    with urllib.request.urlopen(local_s3.endpoint + "/moto-api/data.json") as answer:
        issued = json.loads(answer.read())["sts"]["AssumedRole"]
    ours = {r["access_key_id"] for r in issued if r["role_arn"] == role_arn}
    assert set(keys_used()) <= ours and len(ours) >= 2
    assert "store credentials: irsa" in agent.log()


def test_no_secret_and_no_pod_identity_is_refused_never_the_nodes_role(tmp_path: Path) -> None:
    """The trainer runs unprotected, and the reason is said; before, the sidecar exited 3
    and the native sidecar's startupProbe kept the trainer from ever starting."""
    agent = AgentProcess(root=tmp_path, destination="s3://bucket-x/ns-a/job-1", s3_env={})
    try:
        agent.start()
        reason = agent.runs_unprotected()
    finally:
        agent.kill()
    assert "no credentials for the store" in reason
    log = agent.log()
    assert "no credentials for the store" in log and "node's instance role is never used" in log


def test_no_credentials_hold_the_trainer_when_the_platform_chose_fail_closed(
    tmp_path: Path,
) -> None:
    agent = AgentProcess(
        root=tmp_path,
        destination="s3://bucket-x/ns-a/job-1",
        s3_env={},
        extra_env={"JITCKPT_STORE_UNREACHABLE": "fail-closed"},
    )
    try:
        agent.start()
        assert agent.wait() == 3
    finally:
        agent.kill()
    message = agent.termination()["message"]
    assert "no credentials for the store" in message and "fail-closed" in message


class PodIdentityAgent:
    """The EKS Pod Identity agent's credentials endpoint on 127.0.0.1: it answers only a
    request that presents the pod's token, with keys that expire in an hour."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.key = f"ASIAPODIDENTITY{uuid.uuid4().hex[:5].upper()}"
        self.calls: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.calls.append(self.headers.get("Authorization", ""))
                if self.headers.get("Authorization") != outer.token:
                    self.send_response(403)
                    self.end_headers()
                    return
                expiry = datetime.now(UTC) + timedelta(hours=1)
                body = json.dumps(
                    {
                        "AccessKeyId": outer.key,
                        "SecretAccessKey": "pod-identity-secret",
                        "Token": "pod-identity-session",
                        "Expiration": expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/credentials"

    def __enter__(self) -> PodIdentityAgent:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_eks_pod_identity_is_used_with_the_pods_token(
    bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    token = tmp_path / "eks-pod-identity-token"
    token.write_text("pod-token-for-team-a")
    with PodIdentityAgent("pod-token-for-team-a") as endpoint:
        agent = AgentProcess(
            root=tmp_path,
            destination=f"s3://{bucket}/ns-a/job-1",
            s3_env={
                "AWS_CONTAINER_CREDENTIALS_FULL_URI": endpoint.uri,
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": str(token),
                "AWS_DEFAULT_REGION": REGION,
                "AWS_S3_ENDPOINT": proxy.endpoint,
            },
        )
        try:
            agent.start()
            agent.wait_ready()
            assert agent.status()["identity"] == {
                "kind": "eks-pod-identity",
                "source": f"EKS Pod Identity at {endpoint.uri}, token {token}",
            }
            client = Client(str(agent.socket))
            client.call(shimtalk.hello(4242))
            upload(agent, client, 10)
            client.close()
            assert agent.terminate() == 0
        finally:
            agent.kill()
    assert endpoint.calls and set(endpoint.calls) == {"pod-token-for-team-a"}
    assert {r.access_key for r in proxy.requests if r.access_key} == {endpoint.key}

"""An S3 server that checks credentials (moto's IAM auth, switched on after setup).

Once on, a key the server does not know, or one deleted, is refused: a client
that kept a rotated-out key, or fell back to some other identity, fails.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import boto3
from botocore.exceptions import ClientError

from local.s3server import ACCESS_KEY, REGION, SECRET_KEY, LocalS3

S3_POLICY = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
)


class IamStore:
    """An S3 server that refuses unknown keys, a bucket, and a user allowed on it."""

    def __init__(self, server: LocalS3) -> None:
        self.server = server
        self.bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        self.iam = self.client("iam", ACCESS_KEY, SECRET_KEY)  # admin until auth is on
        self.iam.create_user(UserName="trainer")
        self.iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=S3_POLICY)
        self.iam.create_user(UserName="admin")  # the test's own, to rotate the trainer's keys
        self.iam.put_user_policy(
            UserName="admin", PolicyName="keys", PolicyDocument=S3_POLICY.replace("s3:", "iam:")
        )
        self.client("s3", ACCESS_KEY, SECRET_KEY).create_bucket(Bucket=self.bucket)
        admin = self.iam.create_access_key(UserName="admin")["AccessKey"]
        request = urllib.request.Request(
            server.endpoint + "/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request, timeout=10).close()
        self.iam = self.client("iam", admin["AccessKeyId"], admin["SecretAccessKey"])

    def client(self, service: str, key: str, secret: str, token: str | None = None) -> Any:
        return boto3.client(
            service,
            endpoint_url=self.server.endpoint,
            region_name=REGION,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            aws_session_token=token,
        )

    def new_key(self) -> tuple[str, str]:
        key = self.iam.create_access_key(UserName="trainer")["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def data_connection(self, key: tuple[str, str]) -> dict[str, str]:
        """An S3 Secret's data (an OpenShift AI data connection's keys) for ``key``."""
        return {
            "AWS_ACCESS_KEY_ID": key[0],
            "AWS_SECRET_ACCESS_KEY": key[1],
            "AWS_S3_ENDPOINT": self.server.endpoint,
            "AWS_DEFAULT_REGION": REGION,
        }

    def accepts(self, key: tuple[str, str]) -> bool:
        try:
            self.client("s3", *key).list_objects_v2(Bucket=self.bucket)
        except ClientError:
            return False
        return True

"""Checkpoints in object storage (issue 32), against a real S3 server (SeaweedFS).

The session's server is ``tests/s3_server.py`` (fixture ``s3_server`` in ``conftest.py``);
faults are real: the server killed and restarted, wrong keys, a missing bucket, an
object overwritten through the S3 API.
"""

from __future__ import annotations

import pytest


def test_server_refuses_wrong_credentials(s3_server):
    bucket = s3_server.make_bucket()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="k", Body=b"v")
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
        s3_server.client(secret_key="wrong", retries=0).get_object(Bucket=bucket, Key="k")

"""Shared pytest fixtures."""

from __future__ import annotations

import socket

import pytest

# --- s3_server: an in-process S3 (moto server mode) for fsspec/s3fs tests ----------------------
# Self-contained: it needs nothing else from this file. Server mode (a real HTTP endpoint) rather
# than moto's in-process mock, so that subprocesses and Ray workers can reach the same buckets.

S3_TEST_BUCKET = "ppoflow-test"


@pytest.fixture(scope="session")
def s3_server():
    """Start moto's S3 server for the session and yield ``(endpoint_url, storage_options)``.

    The bucket ``ppoflow-test`` exists; ``storage_options`` are s3fs options (dummy credentials,
    the endpoint). The AWS_* environment variables are set for the session too, so subprocesses
    and boto clients find the same dummy credentials. Tests sharing the server should write
    under a prefix of their own.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:  # ask the OS for a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint_url = f"http://127.0.0.1:{port}"
    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    try:
        with pytest.MonkeyPatch.context() as environment:
            environment.setenv("AWS_ACCESS_KEY_ID", credentials["aws_access_key_id"])
            environment.setenv("AWS_SECRET_ACCESS_KEY", credentials["aws_secret_access_key"])
            environment.setenv("AWS_DEFAULT_REGION", "us-east-1")
            environment.setenv("AWS_REGION", "us-east-1")
            s3 = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1", **credentials)
            s3.create_bucket(Bucket=S3_TEST_BUCKET)
            storage_options = {
                "key": credentials["aws_access_key_id"],
                "secret": credentials["aws_secret_access_key"],
                "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
            }
            yield endpoint_url, storage_options
    finally:
        server.stop()

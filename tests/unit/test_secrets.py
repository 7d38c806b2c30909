"""Credential-like names are found by their words at any depth, and redacted wherever spec data is shown."""

from __future__ import annotations

import pytest

from training.secrets import REDACTED, find_credentials, is_credential_name, redact, redact_text

CREDENTIALS = [
    "key",
    "secret",
    "token",
    "password",
    "aws_secret_access_key",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "accountKey",
    "sas_token",
    "api_key",
    "connection_string",
    "db-passwd",
]
NOT_CREDENTIALS = [
    "tokenizer",
    "tokenizer_sha256",
    "eos_token",
    "token_dtype",
    "max_tokens",
    "train_tokens",
    "ssh_key_path",
    "key_path",
    "token_file",
    "check_password_auth",
    "cache_key_prefix",
    "endpoint_url",
    "client_kwargs",
    "NCCL_DEBUG",
    "monkey",
]


@pytest.mark.parametrize("name", CREDENTIALS)
def test_a_credential_name_is_recognised_by_its_words(name: str) -> None:
    assert is_credential_name(name)


@pytest.mark.parametrize("name", NOT_CREDENTIALS)
def test_a_name_that_only_contains_a_secret_word_is_not_a_credential(name: str) -> None:
    assert not is_credential_name(name)


def test_credentials_are_found_at_every_depth_with_the_variable_to_use_instead() -> None:
    data = {
        "storage": {"options": {"key": "AKIA", "client_kwargs": {"aws_secret_access_key": "s"}}},
        "nodes": {"hosts": [{"name": "a"}, {"name": "b", "password": 123456}]},
        "flags": {"check_password_auth": True, "token": ""},
    }
    assert find_credentials(data) == [
        (("storage", "options", "key"), "AWS_ACCESS_KEY_ID"),
        (("storage", "options", "client_kwargs", "aws_secret_access_key"), "AWS_SECRET_ACCESS_KEY"),
        (("nodes", "hosts", 1, "password"), "PASSWORD"),
    ]


def test_redact_replaces_credential_values_and_url_passwords_and_keeps_the_rest() -> None:
    data = {
        "name": "tiny",
        "storage": {
            "s3_endpoint_url": "http://minio:hunter2@127.0.0.1:9000",
            "options": {"client_kwargs": {"aws_secret_access_key": "hunter2", "region_name": "eu-west-1"}},
        },
        "env": [{"HF_TOKEN": "hunter2"}],
    }
    out = redact(data)
    assert "hunter2" not in str(out)
    assert out["storage"]["options"]["client_kwargs"] == {"aws_secret_access_key": REDACTED, "region_name": "eu-west-1"}
    assert out["storage"]["s3_endpoint_url"] == f"http://minio:{REDACTED}@127.0.0.1:9000"
    assert out["name"] == "tiny" and out["env"] == [{"HF_TOKEN": REDACTED}]
    assert data["env"] == [{"HF_TOKEN": "hunter2"}]  # a copy: the input is left alone
    assert redact_text("s3://bucket/path and https://host/x") == "s3://bucket/path and https://host/x"

"""Redaction: names that mean a secret are masked, ordinary names are not; secret values are
masked in every form they are written in (raw, JSON-escaped, in a URL), and log records
routed to files are redacted like the run's own."""

import json
import logging
from pathlib import Path

import pytest

from scaletrain.tracking.logs import JsonFormatter, route_loggers_to_file
from scaletrain.tracking.redact import MASK, Redactor, is_secret_key, redact_url

SECRET_NAMES = [
    "api_token", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_KEY", "AZURE_CLIENT_SECRET", "DATABASE_DSN", "SENTRY_DSN", "GITHUB_PAT", "SCALETRAIN_CHECKPOINT_KEY",
    "GPG_PASSPHRASE", "MYSQL_PWD", "db_pwd", "OPENAI_API_KEY", "apiKey", "AccountKey",
    "X-Amz-Signature", "X-Amz-Security-Token", "x-api-key", "private_key", "client_secret",
    "password", "passwd", "secret", "token", "credentials", "authorization", "storage.aws_secret_access_key",
    "task.args.api_token", "refreshToken", "db_password2", "conn_str", "ssh_key", "use_auth_token",
    "secret_key_b64", "session_cookie", "RAY_AUTH_TOKEN",
]

ORDINARY_NAMES = [
    "PWD", "OLDPWD", "pad_token_id", "num_key_value_heads", "session_len", "max_tokens",
    "tokenizer", "TOKENIZERS_PARALLELISM", "pad_token", "eos_token", "bos_token_id", "key",
    "sort_key", "label_key", "AWS_ACCESS_KEY_ID", "secret_name", "password_file", "token_path",
    "tokens_per_second", "optim.lr", "num_tokens", "SSH_AUTH_SOCK", "keyword", "monkey",
    "compat", "spat", "signature_dim_tokens", "authority", "auth_enabled", "task.args.secret_note",
    "MLFLOW_TRACKING_USERNAME", "passthrough", "DATABASE_URL", "session", "key_value_heads",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_names_that_mean_a_secret_are_secret(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ORDINARY_NAMES)
def test_ordinary_names_are_not(name):
    assert not is_secret_key(name)


@pytest.mark.parametrize("name, key, expected", [
    ("webhook_url", "SLACK_WEBHOOK_URL", True),
    ("webhook_url", "task.args.webhookUrl", True),
    ("webhook_url", "webhook", False),
    ("WANDB_ENTITY", "wandb_entity", True),
    ("entity", "wandb_entity", True),
    ("entity", "entity_count", False),
])
def test_secret_names_extend_the_rule_by_trailing_words(name, key, expected):
    assert is_secret_key(key, [name]) is expected
    assert Redactor(environ={}, names=[name]).value(key, "some-value-123") == (MASK if expected else "some-value-123")


def test_the_environment_contributes_values_of_secret_names_only(tmp_path):
    environ = {"PWD": str(tmp_path), "OLDPWD": "/home/someone", "HF_TOKEN": "hf_abcdef123456",
               "PAD_TOKEN_ID": "12345678", "SHORT_TOKEN": "abc"}
    redactor = Redactor(environ=environ)
    line = f"saved to {tmp_path}/runs; came from /home/someone; token hf_abcdef123456 id 12345678 abc"
    assert redactor.text(line) == (
        f"saved to {tmp_path}/runs; came from /home/someone; token *** id 12345678 abc"
    )


SECRET = 'p"ss\\w0rd-é'


@pytest.mark.parametrize("form", [
    SECRET,
    json.dumps(SECRET)[1:-1],
    json.dumps(SECRET, ensure_ascii=False)[1:-1],
    repr(SECRET)[1:-1],
])
def test_a_known_secret_is_masked_in_every_form_it_is_written_in(form):
    redactor = Redactor([SECRET], environ={})
    assert redactor.text(f"before {form} after") == "before *** after"


def test_json_encodes_after_masking():
    redactor = Redactor([SECRET], environ={"HF_TOKEN": "hf_secret_éé_value"})
    text = redactor.json({"message": f"using {SECRET} and hf_secret_éé_value", "api_token": "x" * 8,
                          "path": Path("/data") / SECRET, "n": 3, "ok": True})
    assert json.loads(text) == {"message": "using *** and ***", "api_token": MASK, "path": "/data/***",
                                "n": 3, "ok": True}


@pytest.mark.parametrize("url, masked", [
    ("https://ghp_ABCDEFabcdef0123456789@github.com/org/repo.git",
     "https://***@github.com/org/repo.git"),
    ("https://user:p@ss@host:8443/x", "https://***@host:8443/x"),
    ("postgresql://alice:s3cret@db.example/mlflow", "postgresql://***@db.example/mlflow"),
    ("https://bucket.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F2024&"
     "X-Amz-Signature=abcdef0123456789&X-Amz-Expires=3600",
     "https://bucket.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=***&"
     "X-Amz-Signature=***&X-Amz-Expires=3600"),
    ("https://api.example/v1?token=qtok-123456&page=2", "https://api.example/v1?token=***&page=2"),
    ("https://maps.example/api?key=AIzaSyA-123456&q=x", "https://maps.example/api?key=***&q=x"),
    ("https://acct.blob.core.windows.net/c/b?sv=2022&sig=abc%2Bdef%3D", "https://acct.blob.core.windows.net/c/b?sv=2022&sig=***"),
    ("https://host/runs/digits/step-00000100?max_tokens=512", "https://host/runs/digits/step-00000100?max_tokens=512"),
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ("git@github.com:org/repo.git", "git@github.com:org/repo.git"),
])
def test_urls_lose_their_userinfo_and_secret_query_values(url, masked):
    assert redact_url(url) == masked
    assert Redactor(environ={}).text(f"fetch {url} now") == f"fetch {masked} now"


@pytest.mark.parametrize("text, masked", [
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=bXlrZXk+/==;EndpointSuffix=core",
     "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***;EndpointSuffix=core"),
    ("--set task.args.api_token=abc123xyz --set optim.lr=0.1",
     "--set task.args.api_token=*** --set optim.lr=0.1"),
    ("Authorization: Bearer abcdefghijklmnop.qrs", "Authorization: Bearer ***"),
    ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl here", "jwt *** here"),
    ("pad_token_id=3 num_key_value_heads=8 max_tokens=64", "pad_token_id=3 num_key_value_heads=8 max_tokens=64"),
    # a run card's package pins: "auth" ends a secret's name, "==" is no assignment
    ("google-auth==2.40.0 requests-oauthlib==2.0.0 http_auth=abc123", "google-auth==2.40.0 requests-oauthlib==2.0.0 http_auth=***"),
])
def test_secret_assignments_in_free_text(text, masked):
    assert Redactor(environ={}).text(text) == masked


def test_a_secret_named_mapping_is_masked_but_booleans_and_empty_values_stay():
    redactor = Redactor(environ={})
    job = {"task": {"args": {"api_token": "tok-123456", "use_auth_token": True, "password": "",
                             "pad_token_id": 3, "tokenizer": "bpe", "credentials": {"user": "u", "key": "k"}}}}
    assert redactor.value("", job) == {"task": {"args": {
        "api_token": MASK, "use_auth_token": True, "password": "", "pad_token_id": 3,
        "tokenizer": "bpe", "credentials": MASK}}}


def test_for_config_reads_the_jobs_secret_names():
    config = {"task": {"args": {"webhook": "https://hooks.example/T0/B0/abcdefgh", "note": "x"}},
              "tracking": {"secret_names": ["webhook"]}}
    redactor = Redactor.for_config(config, environ={})
    assert redactor.value("", config)["task"]["args"]["webhook"] == MASK
    assert redactor.text("posting to https://hooks.example/T0/B0/abcdefgh") == "posting to ***"


def test_loggers_routed_to_a_file_are_redacted(tmp_path):
    """torch elastic's and Ray's records share the run's logs: they get the run's redactor."""
    redactor = Redactor([SECRET], environ={"HF_TOKEN": "hf_secret_éé_value"})
    path = tmp_path / "logs" / "launcher.jsonl"
    undo = route_loggers_to_file(("torch.distributed.elastic.test",), path, logging.INFO, redactor=redactor)
    try:
        logging.getLogger("torch.distributed.elastic.test").info(
            "worker env %s at https://tok_user_1234567@host/x", {"secret": SECRET, "hf": "hf_secret_éé_value"}
        )
    finally:
        undo()
    text = path.read_text(encoding="utf-8")
    for form in (SECRET, json.dumps(SECRET)[1:-1], "hf_secret_", "tok_user"):
        assert form not in text
    assert json.loads(text)["message"] == "worker env {'secret': '***', 'hf': '***'} at https://***@host/x"


def test_json_formatter_redacts_fields_before_encoding():
    redactor = Redactor([SECRET], environ={})
    record = logging.makeLogRecord({"msg": "token %s", "args": (SECRET,), "levelname": "INFO",
                                    "name": "scaletrain", "api_key": "abcdef-123", "path": "/work/x"})
    entry = json.loads(JsonFormatter(redactor).format(record))
    assert (entry["message"], entry["api_key"], entry["path"]) == ("token ***", MASK, "/work/x")

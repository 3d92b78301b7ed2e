"""Secrets never leave: redaction for params, tags, artifacts and log lines.

A value is secret when its key looks like one (token, password, secret, key, credentials...),
when it is the password in a URL's user-info, or when it equals the value of an environment
variable whose name looks like one. Redacted text reads ``***``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Redactor", "is_secret_key", "flatten"]

MASK = "***"
_SECRET_WORDS = {
    "token", "password", "passwd", "pwd", "secret", "key", "apikey", "credential",
    "credentials", "auth", "authorization", "cookie", "session",
}
_URL_WITH_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^/\s:@]+)(?::([^/\s@]*))?@")


def is_secret_key(key: str) -> bool:
    """``optim.lr`` no, ``storage.aws_secret_access_key`` and ``api-token`` yes."""
    words = re.split(r"[^a-zA-Z0-9]+|(?<=[a-z])(?=[A-Z])", key)
    return any(word.lower() in _SECRET_WORDS for word in words if word)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class Redactor:
    """Knows the secret values of this run and masks them wherever they appear."""

    def __init__(self, secrets: Iterable[str] = (), environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        values = {s for s in secrets if s}
        values |= {v for k, v in env.items() if v and is_secret_key(k)}
        # Short values (a PIN, "1") would mask unrelated text; real secrets are longer.
        self._values = sorted((v for v in values if len(v) >= 6), key=len, reverse=True)

    @classmethod
    def for_config(cls, config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Redactor:
        secrets = [
            str(v) for k, v in flatten(config).items() if is_secret_key(k) and v not in (None, "")
        ]
        return cls(secrets, environ)

    def text(self, text: str) -> str:
        text = _URL_WITH_USERINFO.sub(_mask_userinfo, text)
        for value in self._values:
            if value in text:
                text = text.replace(value, MASK)
        return text

    def value(self, key: str, value: Any) -> Any:
        if is_secret_key(key) and value not in (None, ""):
            return MASK
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {k: self.value(f"{key}.{k}", v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(key, v) for v in value]
        return value

    def mapping(self, data: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self.value(k, v) for k, v in data.items()}


def _mask_userinfo(match: re.Match) -> str:
    scheme, user, password = match.group(1), match.group(2), match.group(3)
    if password is None:
        return f"{scheme}{user}@"
    return f"{scheme}{user}:{MASK}@"


def redact_url(url: str) -> str:
    """The URL without its password, for display."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))

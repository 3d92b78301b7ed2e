"""Secrets never leave: redaction for params, tags, artifacts and log lines.

A value is secret when its name means a secret, when it is a URL's user-info, or when it equals
the value of an environment variable whose name means a secret. A name means a secret by its
last words (split at ``.``, ``_``, ``-`` and camelCase), as secret scrubbers do: ``api_token``,
``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``DATABASE_DSN`` do; ``pad_token_id``,
``num_key_value_heads``, ``max_tokens``, ``PWD`` do not. A job adds names with
``tracking.secret_names``. Values are masked before anything encodes them (JSON, a URL), and
in their escaped forms too. Redacted text reads ``***``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, quote_plus

__all__ = ["MASK", "Redactor", "is_secret_key", "flatten", "redact_url"]

MASK = "***"
# A last word that means a secret on its own (also at the end of one word: "authtoken").
_SECRET_WORDS = {
    "password", "passwords", "passwd", "passphrase", "passcode", "secret", "secrets", "token",
    "credential", "credentials", "apikey", "accesskey", "privatekey", "secretkey", "dsn", "pat",
    "signature", "auth", "authorization", "cookie", "cookies", "connstr", "connectionstring", "jwt",
}
_SECRET_SUFFIXES = ("password", "passwd", "passphrase", "secret", "token", "apikey")
# "key" is a secret only as an api/access/private... key; a bare "pwd" never is (PWD, OLDPWD).
_KEY_KINDS = {
    "api", "access", "private", "secret", "signing", "encryption", "master", "account", "client",
    "ssh", "storage", "checkpoint", "license", "auth", "session", "shared", "hmac", "deploy",
}
# A webhook's URL carries its credential in its path (SCALETRAIN_ALERT_WEBHOOK_URL, SLACK_WEBHOOK_URL).
_SECRET_PAIRS = {("connection", "string"), ("connection", "str"), ("conn", "str"), ("conn", "string"),
                 ("webhook", "url")}
# "pad_token", "eos_token", "max_token": a tokenizer's token or a count, not a credential.
_NOT_CREDENTIAL_TOKENS = {
    "pad", "bos", "eos", "unk", "sep", "cls", "mask", "special", "start", "end", "stop", "max", "min", "num",
}
_ENCODINGS = {"value", "b64", "base64"}  # secret_key_b64 is still the secret key
# In a URL's query, a bare "key" (Google APIs) and "sig" (Azure SAS) are credentials.
_QUERY_WORDS = {"key", "sig"}

_URL_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s\"'<>]*@")
# name=value in query strings, connection strings and command lines.
# Not a comparison or a package pin (google-auth==2.40.0: "auth" is a secret's word).
_ASSIGNMENT = re.compile(r"(?<![\w.-])([A-Za-z_][\w.-]*)=(?!=)([^\s&;#\"'<>]+)")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}")
_JWT = re.compile(r"\beyJ[\w-]{4,}\.[\w-]{4,}\.[\w-]+")
_WORD = re.compile(r"[^a-zA-Z0-9]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def _words(name: str) -> list[str]:
    """``task.args.apiKey`` -> [api, key]: the last dotted part, split into lowercase words."""
    last = name.rsplit(".", 1)[-1]
    words = [w.lower() for w in _WORD.split(last) if w]
    while words and words[-1].isdigit():  # password_2
        words.pop()
    return words


def _means_secret(words: list[str]) -> bool:
    if len(words) > 1 and words[-1] in _ENCODINGS:
        words = words[:-1]
    if not words:
        return False
    last, before = words[-1].rstrip("0123456789") or words[-1], words[-2] if len(words) > 1 else None
    if before is not None and ((before, last) in _SECRET_PAIRS or (last == "key" and before in _KEY_KINDS)):
        return True
    if last == "pwd":
        return before is not None
    if last == "token" and before in _NOT_CREDENTIAL_TOKENS:
        return False
    return last in _SECRET_WORDS or last.endswith(_SECRET_SUFFIXES)


def is_secret_key(key: str, names: Iterable[str] = ()) -> bool:
    """Does the name mean a secret? ``names``: more names, matched by their trailing words
    (``webhook_url`` matches ``SLACK_WEBHOOK_URL`` and ``webhookUrl``)."""
    return _is_secret(key, tuple(names))


@functools.lru_cache(maxsize=4096)  # every log record asks again about the same few names
def _is_secret(key: str, names: tuple[str, ...]) -> bool:
    words = _words(key)
    for name in names:
        wanted = _words(name)
        if wanted and words[-len(wanted):] == wanted:
            return True
    return _means_secret(words)


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

    def __init__(self, secrets: Iterable[str] = (), environ: Mapping[str, str] | None = None,
                 names: Iterable[str] = ()):
        env = os.environ if environ is None else environ
        self.names = tuple(names)
        values = {s for s in secrets if s}
        values |= {v for k, v in env.items() if v and is_secret_key(k, self.names)}
        # Short values (a PIN, "1") would mask unrelated text; real secrets are longer.
        forms = {form for v in values if len(v) >= 6 for form in _written_forms(v)}
        self._values = sorted(forms, key=len, reverse=True)

    @classmethod
    def for_config(cls, config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Redactor:
        names = (config.get("tracking") or {}).get("secret_names") or ()
        return cls(_secret_values(config, names), environ, names)

    def text(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, MASK)
        return _mask_patterns(text, self.names)

    def value(self, key: str, value: Any) -> Any:
        if is_secret_key(key, self.names) and value not in (None, "") and not isinstance(value, bool):
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

    def json(self, data: Any, **dumps: Any) -> str:
        """``json.dumps`` of the redacted data: masked before encoding, so an escaped secret
        (a quote, a backslash, an accent) cannot slip past."""
        return json.dumps(self.value("", data), default=lambda o: self.text(str(o)), **dumps)


def _secret_values(data: Any, names: Iterable[str], secret: bool = False) -> list[str]:
    """Every value under a secret name, also inside a secret-named mapping or list."""
    if isinstance(data, Mapping):
        return [v for k, item in data.items()
                for v in _secret_values(item, names, secret or is_secret_key(str(k), names))]
    if isinstance(data, (list, tuple)):
        return [v for item in data for v in _secret_values(item, names, secret)]
    if secret and data not in (None, "") and not isinstance(data, bool):
        return [str(data)]
    return []


def _written_forms(value: str) -> set[str]:
    """The value as JSON, a Python repr and a URL write it."""
    return {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1],
            repr(value)[1:-1], quote(value, safe=""), quote_plus(value, safe="")}


def _mask_patterns(text: str, names: Iterable[str] = ()) -> str:
    if "://" in text:
        text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    if "=" in text:
        text = _ASSIGNMENT.sub(lambda m: _mask_assignment(m, names), text)
    text = _BEARER.sub(lambda m: m.group(1) + MASK, text)
    return _JWT.sub(MASK, text)


def _mask_assignment(match: re.Match, names: Iterable[str]) -> str:
    name = match.group(1)
    start = match.start()
    in_query = start > 0 and match.string[start - 1] in "?&"
    if is_secret_key(name, names) or (in_query and _words(name)[-1:] and _words(name)[-1] in _QUERY_WORDS):
        return f"{name}={MASK}"
    return match.group(0)


def redact_url(url: str) -> str:
    """The URL without its user-info and secret query values, for display."""
    return _mask_patterns(url)

"""Credential-like names and values in spec data: found at any depth, refused at the boundary, redacted where shown.

Secrets never sit in specs: they come from the job's environment or a Prefect
Secret block. A name is credential-like by its words (`aws_secret_access_key`,
`HF_TOKEN`, `password`, s3fs's bare `key`/`secret`), not by substrings, so that
`tokenizer`, `eos_token`, `ssh_key_path` and `train_tokens` are not mistaken for one.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

# A word that makes a name a credential wherever it stands.
_SECRET_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwd",
        "passphrase",
        "pass",
        "pwd",
        "credential",
        "credentials",
        "apikey",
        "accesskey",
        "secretkey",
        "privatekey",
        "sastoken",
        "token",
        "bearer",
        "cookie",
    }
)
# `key` is a credential on its own (s3fs's `key`) or after one of these (`access_key`, `account_key`).
_KEY_QUALIFIERS = frozenset({"access", "secret", "private", "api", "account", "master", "session", "sas", "signing"})
# `<special>_token` names a vocabulary entry (eos_token), not a credential.
_VOCABULARY_TOKENS = frozenset({"eos", "bos", "pad", "unk", "sep", "cls", "mask", "special", "start", "end"})
# A last word that makes the value a reference to a secret or a setting about one, not the secret itself
# (`ssh_key_path`, `token_file`, `check_password_auth`, `token_dtype`).
_REFERENCE_WORDS = frozenset(
    {"path", "file", "dir", "url", "uri", "env", "var", "name", "names", "kind", "type", "auth"}
    | {"dtype", "length", "size", "count", "limit", "bytes", "fraction", "frequency"}
)
# s3fs / fsspec option names and the variables that carry them instead.
_VARIABLES = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# `user:password@` right after a `scheme://`. Matched only at each "://" (one pass over the text, each authority
# scanned once: it ends at the next '/'), never by a search that would retry a long word from every position.
_SEPARATOR = "://"
_SCHEME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+.-")
_USER_PASSWORD = re.compile(r"[^/@:\s]*:(?P<password>[^/@\s]+)@")
_USER_PASSWORD_CUT = re.compile(r"[^/@:\s]*:(?P<password>[^/@\s]+)(?:@|\Z)")


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(name)]


def is_credential_name(name: object) -> bool:
    """True for a key that names a credential (`aws_secret_access_key`, `HF_TOKEN`, `key`), not a path to one."""
    if not isinstance(name, str):
        return False
    words = _words(name)
    if not words or words[-1] in _REFERENCE_WORDS:
        return False
    for i, word in enumerate(words):
        before = words[i - 1] if i else ""
        if word == "token" and before in _VOCABULARY_TOKENS:
            continue
        if word in _SECRET_WORDS:
            return True
        if word == "key" and (len(words) == 1 or before in _KEY_QUALIFIERS):
            return True
    if "connection" in words and "string" in words:  # Azure connection strings carry the account key
        return True
    return False


def _has_value(value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, dict):
        return any(_has_value(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_value(v) for v in value)
    return value != ""


def variable_for(name: str) -> str:
    """The environment variable that should carry the credential spelled `name` in a spec."""
    if name.lower() in _VARIABLES:
        return _VARIABLES[name.lower()]
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").upper() or "the backend's variable"


def find_credentials(data: Any, loc: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], str]]:
    """(location, suggested variable) of every credential-like key with a value, at any depth of `data`."""
    found: list[tuple[tuple[str | int, ...], str]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            here = (*loc, key if isinstance(key, (str, int)) else str(key))
            if is_credential_name(key) and _has_value(value):
                found.append((here, variable_for(str(key))))
            else:
                found += find_credentials(value, here)
    elif isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            found += find_credentials(value, (*loc, index))
    return found


def credential_message(variable: str) -> str:
    """What is wrong with a credential in a spec, and the fix."""
    return (
        f"looks like a credential; secrets never sit in specs: set {variable} in the job's environment "
        "or a Prefect Secret block"
    )


def redact_text(text: str, cut: bool = False) -> str:
    """`text` with the password of any `scheme://user:password@host` replaced, in time linear in its length.

    `cut`: the text is the start of a longer one, so a password that runs to its end (its '@' cut off) is
    replaced too; cut a long value first and redact what is shown, never the other way round."""
    pattern = _USER_PASSWORD_CUT if cut else _USER_PASSWORD
    parts, done = [], 0
    at = text.find(_SEPARATOR)
    while at != -1:
        start = at + len(_SEPARATOR)
        found = pattern.match(text, start) if at > 0 and text[at - 1] in _SCHEME_CHARS else None
        if found is not None:
            parts += [text[done : found.start("password")], REDACTED]
            done = found.end("password")
        at = text.find(_SEPARATOR, found.end() if found is not None else start)
    return "".join(parts) + text[done:] if parts else text


def redact(data: Any) -> Any:
    """A copy of `data` with the value of every credential-like key (at any depth) and URL passwords replaced."""
    if isinstance(data, dict):
        return {
            key: (REDACTED if is_credential_name(key) and _has_value(value) else redact(value))
            for key, value in data.items()
        }
    if isinstance(data, list):
        return [redact(v) for v in data]
    if isinstance(data, tuple):
        return tuple(redact(v) for v in data)
    if isinstance(data, str):
        return redact_text(data)
    return data

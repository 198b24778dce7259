"""Redaction of credentials from any text that may reach a log, a metrics file, a checkpoint's meta or a
terminal: AWS key ids and secrets, secret-looking assignments and URL user info, and the values of the
credential environment variables. Standard library only: every CLI error line goes through it."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


_AWS_KEY_ID = re.compile(
    r"(?<![A-Z0-9])(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|AIPA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])"
)


# A 40-character base64-ish run with upper, lower and a digit: the shape of an AWS secret access key.
_AWS_SECRET = re.compile(
    r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+]{0,39}[A-Z])(?=[A-Za-z0-9/+]{0,39}[a-z])(?=[A-Za-z0-9/+]{0,39}[0-9])"
    r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
)


_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


_SECRET_ASSIGNMENT = re.compile(
    r"(?i)((?<![A-Za-z0-9_\-])(?:(?:aws_)?secret_access_key|secret_key|secret|(?:aws_)?session_token|"
    r"(?:aws_)?security_token|(?:aws_)?access_key_id|access_key|password|passwd|token|api_key|apikey|hf_token|"
    r"auth_token|access_token|x-amz-security-token|x-amz-credential|x-amz-signature|signature|credential)"
    r"[\"']?\s*[=:]\s*[\"']?)([^\s\"'&,;}\]]+)"
)


_SECRET_ENV_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")


# Config keys whose string values are blanked. A bare "token" suffix is not enough ("mask_token" is not a secret).
_SECRET_KEY_NAME = re.compile(
    r"(?i)token|(?:.*[_\-.])?(?:secret(?:[_-]access)?(?:[_-]key)?|password|passwd|credentials?|api[_-]?key|"
    r"access[_-]?key(?:[_-]?id)?|(?:auth|access|api|session|security|hf|wandb|bearer|refresh|github)[_-]?token)"
)


REDACTED = "***"
_extra_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Make :func:`redact` replace this literal value too (e.g. credentials resolved from a profile)."""
    if value and len(value) >= 8:
        _extra_secrets.add(value)


def redact(text: str) -> str:
    """Remove credentials from free text (log lines, error messages, config values).

    Covers: the literal values of the AWS credential environment variables and of registered secrets,
    AWS access key ids, strings shaped like AWS secret keys, ``name=value`` / ``"name": "value"`` pairs
    whose name looks secret, and the ``user:pass@`` part of URLs.
    """
    text = str(text)
    literals = {os.environ.get(name, "") for name in _SECRET_ENV_VARS} | _extra_secrets
    for value in sorted((v for v in literals if len(v) >= 8), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    text = _URL_USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    text = _SECRET_ASSIGNMENT.sub(lambda m: m.group(1) + REDACTED, text)
    text = _AWS_KEY_ID.sub(REDACTED, text)
    return _AWS_SECRET.sub(REDACTED, text)


def redact_config(obj: Any) -> Any:
    """A JSON-friendly deep copy of ``obj`` with secret-named keys blanked and every string redacted."""
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if _SECRET_KEY_NAME.fullmatch(str(key)) and isinstance(value, str | bytes) and value:
                out[str(key)] = REDACTED
            else:
                out[str(key)] = redact_config(value)
        return out
    if isinstance(obj, list | tuple | set | frozenset):
        return [redact_config(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float):
        return obj
    return redact(str(obj))

"""The one exception type users see. The CLI prints it as a single line and exits non-zero (no traceback).

Raise it with a message that names the problem precisely: the file, the dotted recipe key, the line number.
"""

from __future__ import annotations

import errno
import os
import re


class DraftsmithError(Exception):
    """A user-facing error: bad recipe, bad input file, unknown model. Message is one line."""


_HF_TOKEN = re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9_-]+")


def redact(text: str) -> str:
    """``text`` with every hub-token-shaped string (``hf_`` and what follows it) and the exact values of HF_TOKEN and
    DRAFTSMITH_API_KEY (the server's key) masked: for anything printed, logged or returned that might carry one
    (errors, request lines)."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "DRAFTSMITH_API_KEY"):
        secret = os.environ.get(var, "").strip()
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return _HF_TOKEN.sub("hf_***", text)


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a write that failed for lack of disk space (OSError ENOSPC, or safetensors' wrapped
    ``os error 28``)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    msg = str(e)
    return type(e).__name__ == "SafetensorError" and ("code: 28" in msg or "os error 28" in msg.lower())

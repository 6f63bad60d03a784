"""User-facing errors: one clear line naming the problem and the fix."""
from __future__ import annotations


class FlashSpecError(ValueError):
    """Bad input or configuration; the CLI prints the message alone and exits non-zero."""

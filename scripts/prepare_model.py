#!/usr/bin/env python
"""Convert the embedded SmolLM2-135M-Instruct GGUF to a local safetensors cache (idempotent).

    python scripts/prepare_model.py   # -> .cache/models/SmolLM2-135M-Instruct.Q4_1-<sha256[:16]>/

Later loads read the safetensors directory in about a second instead of dequantising the GGUF.
"""
from __future__ import annotations

import sys

from flashspec.errors import FlashSpecError
from flashspec.models.loading import smollm2_dir


def main() -> int:
    try:
        print(f"SmolLM2-135M-Instruct: {smollm2_dir()}")
    except FlashSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

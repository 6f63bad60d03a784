"""Train the low-rank heads shipped beside an EAGLE drafter checkpoint (fp16 safetensors with
provenance in the file's metadata and in a .json beside it).

Each head is trained exactly as on first use (``flashspec.heads.train.load_or_train``, same
cache), then copied to ``<out>/<checkpoint stem>_head_r<R>.safetensors``; list the files under
the drafter's ``heads:`` entry in conf/drafters/*.yaml.

    python scripts/ship_heads.py --ranks d/16 d/32 d/4 --threads 1
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

import torch

from flashspec.heads import read_metadata, resolve_rank
from flashspec.heads.train import HeadTrainSpec, load_or_train
from flashspec.models import load_model
from flashspec.paths import repo_path
from flashspec.drafters.eagle_checkpoint import load_eagle


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="checkpoints/smollm2_eagle_lr72.safetensors")
    p.add_argument("--name", default="eagle_lr72", help="drafter name (messages only)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--ranks", nargs="+", default=["d/16", "d/32", "d/4"])
    p.add_argument("--cache", default=".cache/heads")
    p.add_argument("--out", default="checkpoints")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--set", nargs="*", default=[], help="HeadTrainSpec overrides, e.g. steps=500")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    spec = HeadTrainSpec.from_options({k: _value(v) for k, v in (s.split("=", 1) for s in a.set)})
    target, tok = load_model(a.target)
    ckpt = repo_path(a.checkpoint)
    module, _, _ = load_eagle(ckpt, target)
    for text in a.ranks:
        rank = resolve_rank(text, target.shape.hidden_size)
        t0 = time.perf_counter()
        load_or_train(target, tok, module, rank, a.name, ckpt, repo_path(a.cache), spec)
        cached = sorted(repo_path(a.cache).glob(f"{ckpt.stem}_r{rank}_*.safetensors"),
                        key=lambda f: f.stat().st_mtime)[-1]
        dest = repo_path(a.out) / f"{ckpt.stem}_head_r{rank}.safetensors"
        shutil.copy(cached, dest)
        meta = read_metadata(dest)
        dest.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{text} (r={rank}): {dest} ({dest.stat().st_size / 1e6:.1f} MB) in "
              f"{time.perf_counter() - t0:.0f} s; held-out {json.dumps(meta['metrics'])}", flush=True)
    return 0


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    sys.exit(main())

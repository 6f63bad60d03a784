#!/usr/bin/env python
"""GPU check of the fused top-k verify against the reference: mismatched rows per shape.

The fused top-k path is off on CUDA (``triton_backend.FUSE_TOPK_ON_CUDA = False``: rows fall
back to the reference) because it disagreed with the reference on 0.2-0.4 % of rows on an H200;
this check switches it on and counts the rows (tokens or n_accepted) that differ, 20 seeds per
shape. Prints one JSON line per shape (and the first differing row of the first two seeds).
Output of its H200 run: experiments/results/gpu_checks/verify_topk/ on branch lab-notebook.

    python scripts/device/verify_topk_check.py          # CUDA only
"""
from __future__ import annotations

import json
import sys

import torch

from flashspec.core import SamplingParams
from flashspec.verify import get_backend
from flashspec.verify import triton_backend
from flashspec.verify.sampling import warp_logprobs

# (B, γ, V, temperature, top_k, one-hot draft, logit scale)
CASES = [(4, 3, 49152, 1.0, 50, False, 1.0), (4, 3, 49152, 1.0, 0, False, 1.0),
         (64, 4, 49152, 1.0, 50, False, 1.0), (64, 4, 49152, 1.0, 50, False, 0.05),
         (64, 4, 49152, 1.0, 0, False, 0.05), (64, 4, 49152, 0.7, 0, True, 3.0),
         (64, 4, 32000, 1.0, 20, False, 3.0)]


def main() -> int:
    if not torch.cuda.is_available():
        print("verify_topk_check needs a CUDA GPU", file=sys.stderr)
        return 2
    triton_backend.FUSE_TOPK_ON_CUDA = True   # measure the fused top-k path itself
    ref, tri = get_backend("torch"), get_backend("triton")
    dev = "cuda"
    for (B, g, V, T, k, onehot, scale) in CASES:
        bad = n = 0
        for seed in range(20):
            gen = torch.Generator(device=dev).manual_seed(seed)
            t = scale * torch.randn(B, g + 1, V, device=dev, generator=gen)
            d = t[:, :g] + 0.5 * scale * torch.randn(B, g, V, device=dev, generator=gen)
            p = SamplingParams(T, k)
            toks = torch.multinomial(warp_logprobs(d, p).exp().reshape(-1, V), 1,
                                     generator=gen).view(B, g)
            dl = None if onehot else d
            o1, n1 = ref(t, toks, dl, p, seed)
            o2, n2 = tri(t, toks, dl, p, seed)
            rows = ((o1 != o2).any(1) | (n1 != n2)).nonzero().flatten().tolist()
            bad += len(rows)
            n += B
            if rows and seed < 2:
                r = rows[0]
                print(json.dumps({"shape": [B, g, V, T, k], "row": r, "ref": o1[r].tolist(),
                                  "tri": o2[r].tolist(), "n": [int(n1[r]), int(n2[r])]}))
        print(json.dumps({"B": B, "g": g, "V": V, "T": T, "top_k": k, "onehot": onehot,
                          "scale": scale, "mismatched_rows": bad, "rows": n}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

import torch, json, sys
sys.path.insert(0, ".")
from flashspec.verify import get_backend, SamplingParams
from flashspec.verify.sampling import warp_logprobs
ref, tri = get_backend("torch"), get_backend("triton")
dev = "cuda"
for (B, g, V, T, k, onehot, scale) in [(4,3,49152,1.0,50,False,1.0),(4,3,49152,1.0,0,False,1.0),(64,4,49152,1.0,50,False,1.0),
                                      (64,4,49152,1.0,50,False,0.05),(64,4,49152,1.0,0,False,0.05),(64,4,49152,0.7,0,True,3.0),(64,4,32000,1.0,20,False,3.0)]:
    bad = 0; n = 0
    for seed in range(20):
        gen = torch.Generator(device=dev).manual_seed(seed)
        t = scale * torch.randn(B, g+1, V, device=dev, generator=gen)
        d = t[:, :g] + 0.5 * scale * torch.randn(B, g, V, device=dev, generator=gen)
        p = SamplingParams(T, k)
        toks = torch.multinomial(warp_logprobs(d, p).exp().reshape(-1, V), 1, generator=gen).view(B, g)
        dl = None if onehot else d
        o1, n1 = ref(t, toks, dl, p, seed)
        o2, n2 = tri(t, toks, dl, p, seed)
        rows = ((o1 != o2).any(1) | (n1 != n2)).nonzero().flatten().tolist()
        bad += len(rows); n += B
        if rows and seed < 2:
            r = rows[0]
            print(json.dumps({"shape": [B,g,V,T,k], "row": r, "ref": o1[r].tolist(), "tri": o2[r].tolist(), "n": [int(n1[r]), int(n2[r])]}))
    print(json.dumps({"B": B, "g": g, "V": V, "T": T, "top_k": k, "onehot": onehot, "scale": scale, "mismatched_rows": bad, "rows": n}), flush=True)

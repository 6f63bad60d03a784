import sys, statistics, torch
sys.path.insert(0, ".")
from experiments.kernel_bench import make_inputs, time_calls, graph_time
from flashspec.verify import SamplingParams, reference
from flashspec.verify import triton_backend as tb
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
p = SamplingParams(temperature=1.0)
for shape in ((64, 4, 128256), (64, 8, 128256)):
    bufs = [make_inputs(*shape, torch.bfloat16, "full", 1.0, dev, gen) for _ in range(3)]
    for ff, rc in ((True, None), (False, None), (False, 8192), (True, 8192)):
        tb.FUSE_FINISH = ff
        base = tb.plan(*shape)
        plan = base if rc is None else tb.Plan(1, base.chunk, base.block, rc, 4, 4, fused=False)
        fn = lambda *a: tb.launch(*a, geometry=plan)
        ref = reference.verify(*bufs[0], p, 3)
        got = fn(*bufs[0], p, 3)
        same = torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        eager = statistics.median(time_calls(lambda *b: fn(*b, p, 3), bufs, 200, 10, True))
        g, bad = graph_time(fn, bufs, p, 10)
        print(shape, "fuse_finish", ff, "rchunk", plan.rchunk, "same", same, "graph_same", not bad,
              f"eager {eager:.1f} graph {g:.1f} us", flush=True)

import sys, torch
sys.path.insert(0, ".")
from experiments.kernel_bench import make_inputs
from flashspec.verify import SamplingParams
from flashspec.verify import triton_backend as tb
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
x, tok, q = make_inputs(64, 4, 128256, torch.bfloat16, "full", 1.0, dev, gen)
p = SamplingParams(temperature=1.0)
for _ in range(3):
    tb.launch(x, tok, q, p, 7)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
tb.launch(x, tok, q, p, 7)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done")

import sys, json, torch
sys.path.insert(0, '.'); sys.path.insert(0, 'scripts')
import kernel_profile as kp
from flashspec.verify import triton_backend as tb
flush = torch.empty(kp.FLUSH // 4, dtype=torch.float32, device="cuda")
plans = [tb.Plan(r, 8192, b, rc, rb, w, rw, fused=False)
         for (r, b, rc, rb, w, rw) in [(2, 1024, 8192, 512, 4, 4), (2, 512, 8192, 256, 4, 4),
                                        (2, 1024, 8192, 512, 8, 8), (4, 512, 8192, 256, 4, 4),
                                        (4, 512, 8192, 256, 8, 8), (2, 1024, 4096, 512, 4, 4)]]
def log(rec):
    print(json.dumps(rec), flush=True)
kp.profile_shape((64, 4, 128256), plans, 30, flush, log)

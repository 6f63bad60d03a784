"""Runtime modes (``conf/runtime/*.yaml``): how the decode loop runs, apart from the machine it
runs on (:class:`flashspec.hardware.Hardware`), so that any CUDA profile can run any mode.

``eager`` is the reference loop (every op from Python, the torch verify backend); ``graphed``
replays the verify step (and model drafters' drafting) as CUDA graphs through the fused Triton
paths; ``resident`` keeps the decode state on the device and replays whole draft → verify →
commit steps in chunks (:mod:`flashspec.resident`). Without CUDA the graphed and resident code
paths still run, uncaptured (how the CPU tests check them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from flashspec.errors import FlashSpecError
from flashspec.options import KernelOptions


@dataclass(frozen=True)
class Runtime:
    """How one run executes its decode steps.

    ``verify_backend`` names a registered verify backend; ``cuda_graphs`` runs the verify step
    (and model drafters' drafting) as CUDA graphs; ``compile_step`` torch.compiles that step
    first; ``fused_layers`` runs few-token cached steps through the fused decode layers;
    ``resident_loop`` keeps the decode state on the device and runs each step as device ops
    (:mod:`flashspec.resident`), read back every ``resident_chunk`` steps; ``kernels`` are the
    Triton kernels' switches (:class:`flashspec.options.KernelOptions`).
    """

    name: str
    verify_backend: str = "torch"
    cuda_graphs: bool = False
    compile_step: bool = False
    fused_layers: bool = False
    resident_loop: bool = False
    resident_chunk: int = 1
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        if isinstance(self.resident_chunk, bool) or not isinstance(self.resident_chunk, int) \
                or self.resident_chunk < 1:
            raise FlashSpecError(f"runtime.resident_chunk={self.resident_chunk!r}; it must be a "
                                 "positive int (steps between reads of the device counters)")


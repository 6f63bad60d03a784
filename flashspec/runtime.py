"""Runtime modes (``conf/runtime/*.yaml``): how the decode loop runs, apart from the machine it
runs on (:class:`flashspec.hardware.Hardware`), so that any CUDA profile can run any mode.

``eager`` is the reference stepper (every op from Python, the torch verify backend);
``resident`` keeps the decode state on the device and replays whole draft → verify → commit
steps as CUDA graphs in chunks (:mod:`flashspec.resident`); ``graphed`` is that stepper with one
step a chunk (:mod:`flashspec.stepper`). Without CUDA the captured stepper still runs,
uncaptured (how the CPU tests check it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from flashspec.errors import FlashSpecError
from flashspec.options import KernelOptions


@dataclass(frozen=True)
class Runtime:
    """How one run executes its decode steps.

    ``verify_backend`` names a registered verify backend; ``cuda_graphs`` runs the captured
    stepper (CUDA graphs), one step a chunk unless ``resident_loop``; ``fused_layers`` runs few-token cached steps
    through the fused decode layers;
    ``resident_loop`` keeps the decode state on the device and runs each step as device ops
    (:mod:`flashspec.resident`), read back every ``resident_chunk`` steps; ``kernels`` are the
    Triton kernels' switches (:class:`flashspec.options.KernelOptions`).
    """

    name: str
    verify_backend: str = "torch"
    cuda_graphs: bool = False
    fused_layers: bool = False
    resident_loop: bool = False
    resident_chunk: int = 1
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        if isinstance(self.resident_chunk, bool) or not isinstance(self.resident_chunk, int) \
                or self.resident_chunk < 1:
            raise FlashSpecError(f"runtime.resident_chunk={self.resident_chunk!r}; it must be a "
                                 "positive int (steps between reads of the device counters)")


"""Hardware profiles (``conf/hardware/*.yaml``): where models run and how the step is executed."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashspec.errors import FlashSpecError
from flashspec.options import KernelOptions


@dataclass(frozen=True)
class Hardware:
    """Device, dtype and execution options of one machine kind.

    ``verify_backend`` names a registered verify backend; ``cuda_graphs`` runs the verify step
    (and model drafters' drafting) as CUDA graphs; ``compile_step`` torch.compiles that step
    first; ``fused_layers`` runs few-token cached steps through the fused decode layers;
    ``resident_loop`` keeps the decode state on the device and runs each step as device ops
    (:mod:`flashspec.resident`), read back every ``resident_chunk`` steps.
    ``mem_bandwidth_gbs`` / ``peak_tflops`` only feed memory floors in reports; ``kernels``
    are the Triton kernels' switches (:class:`flashspec.options.KernelOptions`).
    """

    name: str
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str | None = None
    verify_backend: str = "torch"
    cuda_graphs: bool = False
    compile_step: bool = False
    fused_layers: bool = False
    resident_loop: bool = False
    resident_chunk: int = 1
    mem_bandwidth_gbs: float = 20.0
    peak_tflops: float = 0.2
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise FlashSpecError(f"hardware={self.name} needs CUDA; this machine has none — use "
                                 "hardware=cpu")
        if isinstance(self.resident_chunk, bool) or not isinstance(self.resident_chunk, int) \
                or self.resident_chunk < 1:
            raise FlashSpecError(f"hardware.resident_chunk={self.resident_chunk!r}; it must be a "
                                 "positive int (steps between reads of the device counters)")
        if self.quantization not in (None, "nf4"):
            raise FlashSpecError(f"hardware.quantization={self.quantization!r}; use null or nf4")

"""Hardware profiles (``conf/hardware/*.yaml``): what the machine is (device, dtype, quantization,
bandwidth, peak). How the decode loop runs on it is the ``runtime`` group's
(:class:`flashspec.runtime.Runtime`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashspec.errors import FlashSpecError


@dataclass(frozen=True)
class Hardware:
    """Device, dtype and datasheet figures of one machine kind.

    ``quantization`` loads the target's weights quantized (null or nf4);
    ``mem_bandwidth_gbs`` / ``peak_tflops`` only feed memory floors in reports.
    """

    name: str
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str | None = None
    mem_bandwidth_gbs: float = 20.0
    peak_tflops: float = 0.2

    def __post_init__(self) -> None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise FlashSpecError(f"hardware={self.name} needs CUDA; this machine has none — use "
                                 "hardware=cpu")
        if self.quantization not in (None, "nf4"):
            raise FlashSpecError(f"hardware.quantization={self.quantization!r}; use null or nf4")

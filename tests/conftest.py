"""Test-wide settings: Triton kernels run under the interpreter on the CPU (set before import)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

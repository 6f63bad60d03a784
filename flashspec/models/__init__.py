"""Model loading and the native Llama-family decoder with a static KV cache."""
from flashspec.models.llama import KVCache, LlamaLM, LlamaShape
from flashspec.models.loading import load_model, smollm2_dir

__all__ = ["KVCache", "LlamaLM", "LlamaShape", "load_model", "smollm2_dir"]

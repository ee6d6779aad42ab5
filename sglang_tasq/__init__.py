"""sglang-tasq: TaSQ 1-bit vector-quantized KV cache (reference codec, HF cache, SGLang plugin)."""
__version__ = "0.1.0"

"""The quantize step: the exported model quantized with LLM Compressor and gated against the unquantized one."""

"""Quantized weights (issue: quantization). gguf_blocks: GGUF's block formats dequantized by JAX programs, so
a GGUF file's weights can stay in their blocks on the device."""

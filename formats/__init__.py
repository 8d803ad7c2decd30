"""GGUF files: reader, quant block layouts, reference dequantizers."""

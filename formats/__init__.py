"""GGUF files: reader, quant block layouts, reference dequantizers."""

from localllm.formats.gguf import (
    GGMLQuantizationType,
    GGUFError,
    GGUFFile,
    GGUFTensor,
    read_gguf,
)
from localllm.formats.quants import (
    QUANTIZE_TYPES,
    SUPPORTED_TYPES,
    QuantError,
    block_size,
    dequantize,
    quantize,
    row_nbytes,
)
from localllm.formats.writer import write_gguf

__all__ = [
    "QUANTIZE_TYPES",
    "SUPPORTED_TYPES",
    "GGMLQuantizationType",
    "GGUFError",
    "GGUFFile",
    "GGUFTensor",
    "QuantError",
    "block_size",
    "dequantize",
    "quantize",
    "read_gguf",
    "row_nbytes",
    "write_gguf",
]

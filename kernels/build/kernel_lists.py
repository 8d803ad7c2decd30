# ruff: noqa: E501  (signatures are kept on one line each, as generated)
"""Which compiled functions a kind of model needs, for a first run with no kernel cache.

warmup.py records this list on every machine after the first run (next to the kernels);
the copy here lets the very first run compile the default model's kernels in parallel
worker processes (compile_workers.py) instead of discovering them one by one in a forward
pass. Keyed by "architecture [weight types]"; signatures are Numba type reprs; "seconds"
are compile times (CPU seconds) measured on a first run (only used to balance the workers'
shares). The KV cache kernels are listed for f16 K and V; warmup.for_kv_types names the
pair a run uses instead.
A stale entry costs nothing but time: whatever the list misses, the warm-up pass compiles.
Regenerate with `python bench/record_kernel_lists.py [MODEL]` after changing kernels (with a fresh
NUMBA_CACHE_DIR, and LOCALLLM_COMPILE_WORKERS=0 so that one process measures every compile).
"""

KERNEL_LISTS: dict[str, dict] = {
    'gemma3 [0, 6, 8, 12, 14]': {
        "entries": [
        ('localllm.kernels.cpu.dequant', '_rows_q8_0',
         "(Array(uint8, 2, 'C', True, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), int64, int64, Array(float32, 1, 'C', False, aligned=True))"),
        ('localllm.kernels.cpu.mm_r16k', '_repack_r16k',
         "(int64, Array(uint8, 2, 'C', True, aligned=True), Array(uint8, 3, 'C', False, aligned=True), int64, int64)"),
        ('localllm.kernels.cpu.mm_r16', '_repack_r16',
         "(int64, Array(uint8, 2, 'C', True, aligned=True), Array(uint8, 3, 'C', False, aligned=True), int64, int64)"),
        ('localllm.kernels.cpu.quant_act', 'quantize_q8_0',
         "(Array(float32, 2, 'C', False, aligned=True), Array(int8, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True))"),
        ('localllm.kernels.cpu.quant_act', 'quantize_q8_k',
         "(Array(float32, 2, 'C', False, aligned=True), Array(int8, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(int16, 2, 'C', False, aligned=True), Array(int16, 2, 'C', False, aligned=True))"),
        ('localllm.kernels.cpu.mm_driver', '_mm_simd',
         "(int64, int64, Array(uint8, 2, 'C', True, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), int64, int64, int64, int64, int64, int64, int64, int64, int64, bool, int64)"),
        ('localllm.kernels.cpu.mm_driver', '_mm_multi',
         "(Array(int64, 2, 'C', False, aligned=True), int64, Array(float32, 2, 'C', False, aligned=True), int64, int64, int64, int64, int64, int64, int64, bool)"),
        ('localllm.kernels.cpu.region', '_touch',
         "(Array(int64, 1, 'C', False, aligned=True),)"),
        ('localllm.kernels.cpu.kv_quant', '_store_rows',
         "(Array(float32, 3, 'C', False, aligned=True), Array(uint16, 3, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True))"),
        ('localllm.kernels.cpu.kv_quant', '_attention_kernel',
         "(Array(float32, 3, 'C', False, aligned=True), Array(uint16, 3, 'C', False, aligned=True), Array(uint16, 3, 'C', False, aligned=True), int64, Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 2, 'C', False, aligned=True), int64, int64, float32, float32, Array(float32, 1, 'C', False, aligned=True), Array(float32, 3, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), int64, int64, int64, bool, Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True))"),
        ('localllm.kernels.cpu.ops', '_rms_norm3',
         "(Array(float32, 3, 'C', False, aligned=True), Array(float32, 1, 'C', True, aligned=True), float64, Array(float32, 3, 'C', False, aligned=True), bool)"),
        ('localllm.kernels.cpu.ops', '_add_rms_norm',
         "(Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 1, 'C', True, aligned=True), float64, Array(float32, 2, 'C', False, aligned=True), Array(float32, 1, 'C', True, aligned=True), bool)"),
        ('localllm.kernels.cpu.ops', '_rope_apply',
         "(Array(float32, 3, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), bool)"),
        ('localllm.kernels.cpu.ops', '_gelu_ggml_mul_par',
         "(Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True))"),
        ('localllm.kernels.cpu.ops', '_gelu_ggml_mul',
         "(Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True))"),
        ('localllm.kernels.cpu.fused_ffn', '_ffn_step',
         "(Array(int64, 2, 'C', False, aligned=True), Array(int64, 2, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), float64, int64, Tuple((Array(float32, 3, 'C', False, aligned=True), Array(float32, 3, 'C', False, aligned=True), Array(float32, 3, 'C', False, aligned=True), Array(float32, 3, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True),)), Tuple((Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(uint16, 3, 'C', False, aligned=True), Array(uint16, 3, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 2, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True),)))"),
        ('@kernel', 6, 'r16b'),
        ('@kernel', 8, 'r16b'),
        ('@kernel', 12, True),
        ('@kernel', 14, True),
        ('@kernel', 6, 'r16'),
        ('@kernel', 8, 'r16'),
        ('@kernel', 12, 'r16'),
        ('@kernel', 14, 'r16'),
        ('localllm.kernels.cpu.fused_ffn', '_ffn_step1',
         "(Array(int64, 2, 'C', False, aligned=True), Array(int64, 2, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), float64, Tuple((Array(float32, 3, 'C', False, aligned=True), Array(float32, 3, 'C', False, aligned=True), Array(float32, 3, 'C', False, aligned=True), Array(float32, 3, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(float32, 1, 'C', False, aligned=True),)), Tuple((Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(uint16, 3, 'C', False, aligned=True), Array(uint16, 3, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(int64, 2, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(float32, 2, 'C', False, aligned=True), Array(int64, 1, 'C', False, aligned=True),)))"),
        ],
        "seconds": {'localllm.kernels.cpu.dequant:_rows_q8_0': 0.38, 'localllm.kernels.cpu.fused_ffn:_ffn_step': 15.27, 'localllm.kernels.cpu.fused_ffn:_ffn_step1': 9.00, 'localllm.kernels.cpu.kv_quant:_attention_kernel': 9.69, 'localllm.kernels.cpu.kv_quant:_store_rows': 0.47, 'localllm.kernels.cpu.mm_amx:_rows_r16_tiles': 20.02, 'localllm.kernels.cpu.mm_driver:_mm_multi': 2.83, 'localllm.kernels.cpu.mm_driver:_mm_simd': 1.37, 'localllm.kernels.cpu.mm_driver:_rows': 5.88, 'localllm.kernels.cpu.mm_r16:_repack_r16': 0.76, 'localllm.kernels.cpu.mm_r16k:_repack_r16k': 1.08, 'localllm.kernels.cpu.mm_r16k:_rows_r16k45': 2.94, 'localllm.kernels.cpu.mm_r16k:_rows_r16k6': 2.73, 'localllm.kernels.cpu.ops:_add_rms_norm': 0.23, 'localllm.kernels.cpu.ops:_gelu_ggml_mul': 0.09, 'localllm.kernels.cpu.ops:_gelu_ggml_mul_par': 0.59, 'localllm.kernels.cpu.ops:_rms_norm3': 0.27, 'localllm.kernels.cpu.ops:_rope_apply': 0.14, 'localllm.kernels.cpu.quant_act:quantize_q8_0': 1.35, 'localllm.kernels.cpu.quant_act:quantize_q8_k': 0.46, 'localllm.kernels.cpu.region:_touch': 0.16},
    },
}

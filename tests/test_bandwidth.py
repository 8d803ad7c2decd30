"""The decode-limit arithmetic of `localllm bench`: bytes per token and measured bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tiny_models import write_tiny_model

from localllm.formats import read_gguf
from localllm.kernels.cpu.bandwidth import decode_bytes_per_token, read_bandwidth


def _matrix_bytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


@pytest.mark.parametrize("tie", [True, False])
def test_decode_bytes_per_token_counts_every_matrix_once(tmp_path: Path, tie: bool) -> None:
    """Every weight matrix is read once per token; the embedding is one row, or all of it
    when it doubles as the output head. Counted here from shapes and block sizes alone."""
    path = tmp_path / "m.gguf"
    q = GGMLQuantizationType.Q8_0
    write_tiny_model(path, "llama", qtype=q, tie_embeddings=tie)
    gf = read_gguf(path)
    want = 0
    for name, t in gf.tensors.items():
        if len(t.shape) < 2:
            continue
        b = _matrix_bytes(tuple(t.shape), t.type)
        if name == "token_embd.weight":
            b = b if tie else b // t.shape[0]
        want += b
    assert ("output.weight" in gf.tensors) == (not tie)
    assert decode_bytes_per_token(gf) == want
    assert decode_bytes_per_token(gf, depth=10, kv_bytes_per_token=64) == want + 640


def test_decode_bytes_per_token_counts_active_experts_only(tmp_path: Path) -> None:
    """Mixtral-style tiny model (4 experts, 2 per token): of each expert stack a decode step
    reads 2 of 4 experts; routers and attention in full."""
    path = tmp_path / "m.gguf"
    q = GGMLQuantizationType.Q8_0
    write_tiny_model(path, "mixtral", qtype=q)
    gf = read_gguf(path)
    want = 0
    for name, t in gf.tensors.items():
        if len(t.shape) < 2:
            continue
        b = _matrix_bytes(tuple(t.shape), t.type)
        if name == "token_embd.weight":
            b //= t.shape[0]
        if "_exps" in name:
            assert t.shape[0] == 4
            b = b // 4 * 2
        want += b
    assert decode_bytes_per_token(gf) == want


def test_read_bandwidth_is_a_checked_measurement() -> None:
    """A small buffer (it fits in cache, so no statement about DRAM here): the probe sums
    every byte (its checksum is verified inside) and reports a finite positive rate."""
    bw = read_bandwidth(n_threads=1, mib=4, passes=2)
    assert 1e8 < bw < 1e13


def test_bench_bandwidth_reports_decode_as_a_fraction_of_the_limit(tmp_path: Path) -> None:
    """`localllm bench --bandwidth --json`: the limit follows from the two measured parts,
    and the tg test's fraction is its tok/s times bytes per token over the bandwidth."""
    import json
    import subprocess
    import sys

    path = tmp_path / "m.gguf"
    write_tiny_model(path, "llama", qtype=GGMLQuantizationType.Q8_0)
    r = subprocess.run([sys.executable, "-m", "localllm", "bench", str(path), "-p", "0", "-n",
                        "8", "-r", "1", "-t", "1", "--bandwidth", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    lim = out["decode_limit"]
    bw = lim["read_bandwidth_bytes_s"]
    assert bw > 0 and lim["weights_bytes_per_token"] == decode_bytes_per_token(read_gguf(path))
    (t,) = lim["tests"]
    tg = next(x for x in out["results"] if x["test"] == "tg8")
    assert t["bytes_per_token"] > lim["weights_bytes_per_token"]  # plus the K/V it reads
    assert abs(t["limit_ts"] - bw / t["bytes_per_token"]) < 1e-6 * t["limit_ts"]
    assert abs(t["fraction"] - tg["mean_ts"] * t["bytes_per_token"] / bw) < 1e-9


def test_decode_bytes_per_token_counts_the_active_experts(tmp_path: Path) -> None:
    """An MoE token reads its expert_used_count experts of each layer (gpt-oss: 2 of 4 here,
    4 of 32 in gpt-oss-20b), the router and the rest in full."""
    path = tmp_path / "m.gguf"
    q = GGMLQuantizationType.Q8_0
    write_tiny_model(path, "gpt-oss", qtype=q)
    gf = read_gguf(path)
    full = sum(t.data.nbytes for n, t in gf.tensors.items()
               if len(t.shape) >= 2 and n != "token_embd.weight")
    experts = sum(t.data.nbytes for n, t in gf.tensors.items() if "_exps." in n)
    assert experts > 0 and {"output.weight", "blk.0.ffn_down_exps.bias"} <= set(gf.tensors)
    emb_row = gf.tensors["token_embd.weight"].data.nbytes // gf.tensors["token_embd.weight"].shape[0]
    assert decode_bytes_per_token(gf) == full - experts + experts // 2 + emb_row

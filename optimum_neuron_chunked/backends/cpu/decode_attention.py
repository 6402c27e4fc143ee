"""Decode attention as a C++ op (cpu backend only, kernels.decode_attention_op).

A decode step (TG: one query row per block table) reads each row's live K/V once;
that read is the step's cost. ATen's bmm with the 2 query heads of a KV group as its rows runs MKL sgemm far
from the memory stream, so the op (decode_attention.cpp) reads each block of keys and values
once for the group, with the softmax in between, one call a layer for all rows.

The op is compiled on first use in a process, for this host's vector ISA, by torch's extension
builder (ninja and the host's C++ compiler, which AOTInductor needs anyway), and cached by
torch (TORCH_EXTENSIONS_DIR). AOTInductor calls it through its proxy executor, so it must be
loaded before a graph that calls it runs: backends.cpu loads it with the export when the
export's kernel choices include it (`load_op`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .extension import build_op_library
from .host import host_cpu_capability

SOURCE = Path(__file__).with_suffix(".cpp")
# The same flags AOTInductor compiles its kernels with for each ISA (torch/_inductor/cpu_vec_isa.py)
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def compile_flags(isa: str) -> list[str]:
    # -ffast-math: vectorized exp (glibc's libmvec); the op sees no inf or NaN (no -inf mask)
    return ["-O3", "-ffast-math", "-fopenmp", *ISA_FLAGS.get(isa, [])]


LINK_FLAGS = ["-fopenmp", "-lmvec"]


@functools.cache
def load_op() -> None:
    """Build (once per host ISA and source) and register optimum_neuron_chunked::decode_attention,
    unless a build of it is registered in this process already."""
    if hasattr(torch.ops.optimum_neuron_chunked, "decode_attention"):
        return
    isa = host_cpu_capability()
    build_op_library(
        f"optimum_neuron_chunked_decode_attention_{isa.lower()}", SOURCE, compile_flags(isa), LINK_FLAGS
    )
    torch.library.register_fake("optimum_neuron_chunked::decode_attention")(_shape)


def _shape(query, k_cache, v_cache, block_tables, lengths, scale):
    return query.new_empty(query.shape)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [N, Hq, D] (one decode row each), lengths [N] -> [N, Hq, D]: row n over its
    positions 0 .. lengths[n] - 1, read in place. Paged: caches [blocks, Hkv, P, D], block
    tables [N, M], position p at offset p % P of block tables[n, p // P]. Whole-sequence blocks:
    caches [blocks, Hkv, S, D], tables = the rows' blocks [N, 1].
    Query head h reads KV head h // (Hq / Hkv), as transformers' repeat_kv. Padded rows repeat
    a real row: the same result, computed twice. fp32."""
    load_op()
    return torch.ops.optimum_neuron_chunked.decode_attention(query, k_cache, v_cache, tables, lengths, scale)

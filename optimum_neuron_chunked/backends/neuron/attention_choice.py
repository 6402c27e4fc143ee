"""Which graphs of a neuron export attend through AWS's NKI kernel for prefill chunks,
nkilib's `attention_cte` (aws-neuron/nki-library, src/nkilib_src/nkilib/core/attention/
attention_cte.py), decided at export per graph (`--attention-kernel`) and recorded in the
export's config (`NeuronConfig.nki_attention`).

The kernel takes a chunk of queries over a prior K/V with a runtime prior length: the chunk of
CP graphs, of MX graphs and of CE graphs. Decode rows (TG, VF, MX's decode part) keep the
reference: nkilib's decode kernel `attention_tkg` is a sub-kernel that wants q / k already on
chip unless RoPE is fused (attention_tkg.py, 2.29_release l.321-330), and fused RoPE wants
head_dim % 64 == 0 and batch x heads x active tokens <= 128 (l.836-843, l.3197).

The limits are the kernel's `kernel_assert`s on the 2.28 branch, the stricter of the two
published branches (2.29_release allows 512 batch rows and 131072 positions): batch (query
heads of the chunk) <= 32 and divisible by the KV heads (l.377-387), 0 < head_dim <= 128
(l.410-415), prior + active positions <= 36864. The kernel holds its tiles in bf16 (softmax in
fp32): a float32 export keeps the reference, as does a layer whose cache is a ring (not in
position order: nki_kernels.NkiKernels decides that per layer).
"""

from __future__ import annotations

import importlib

from ...config import NeuronConfig, NeuronConfigError
from ...graphs import GraphKind, GraphSpec
from ...modeling.family import FamilySpec
from ...modeling.parallel import ShardLayout

KERNEL_MODULE = "nkilib.core.attention.attention_cte"
CHUNK_KINDS = (GraphKind.CP, GraphKind.MX, GraphKind.CE)
MAX_BATCH = 32
MAX_HEAD_DIM = 128
MAX_POSITIONS = 36864


def nkilib_missing() -> str | None:
    """Why attention_cte cannot be called on this host, or None (neuronx-cc bundles nkilib)."""
    for module in ("nki", KERNEL_MODULE):
        try:
            importlib.import_module(module)
        except Exception as e:  # an SDK's import can fail in many ways; say which
            return f"{module} does not import ({type(e).__name__}: {e})"
    return None


def graph_misfit(config: NeuronConfig, spec: FamilySpec, graph: GraphSpec) -> str | None:
    """Why `graph` cannot run its prefill chunk through attention_cte, or None."""
    if graph.kind is GraphKind.COPY:
        return "it attends over nothing"
    if graph.kind not in CHUNK_KINDS:
        return "decode rows keep the reference attention"
    if config.dtype != "bfloat16":
        return f"the export is {config.dtype} and the kernel computes in bf16 (pass --dtype bfloat16)"
    layout = ShardLayout.of(spec, config.tp_degree)
    heads, kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank
    if not 0 < spec.head_dim <= MAX_HEAD_DIM:
        return f"head_dim {spec.head_dim} is above the kernel's {MAX_HEAD_DIM}"
    if heads > MAX_BATCH or heads % kv_heads:
        return f"{heads} query heads over {kv_heads} KV heads a core: the kernel takes at most {MAX_BATCH}, a multiple"
    width = config.prefill_chunk_size if graph.kind is GraphKind.MX else graph.width
    if graph.window + width > MAX_POSITIONS:
        return f"{graph.window} prior + {width} chunk positions exceed the kernel's {MAX_POSITIONS}"
    return None


def choose_nki_graphs(
    config: NeuronConfig, spec: FamilySpec, graphs: list[GraphSpec]
) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the graphs whose prefill chunks run attention_cte, why each other graph does not).
    `--attention-kernel nki` refuses, by graph, what cannot run it."""
    mode = config.attention_kernel
    if mode == "reference":
        return (), {g.name: "--attention-kernel reference" for g in graphs}
    missing = nkilib_missing()
    reasons = {g.name: missing or graph_misfit(config, spec, g) for g in graphs}
    chosen = tuple(name for name, reason in reasons.items() if reason is None)
    refused = {
        g.name: reasons[g.name] for g in graphs if g.kind in CHUNK_KINDS and reasons[g.name] is not None
    }
    if mode == "nki" and refused:
        said = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
        raise NeuronConfigError(
            f"--attention-kernel nki: {said}. Pass --attention-kernel auto (the kernel where it "
            "fits) or reference."
        )
    return chosen, {name: reason for name, reason in reasons.items() if reason is not None}

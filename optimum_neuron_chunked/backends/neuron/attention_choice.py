"""Which graphs of a neuron export attend through AWS's NKI kernel for prefill chunks,
nkilib's `attention_cte` (aws-neuron/nki-library, src/nkilib_src/nkilib/core/attention/
attention_cte.py), decided at export per graph (`--attention-kernel`) and recorded in the
export's config (`NeuronConfig.nki_attention`, `NeuronConfig.nki_limits`).

The kernel takes a chunk of queries over a prior K/V with a runtime prior length: the chunk of
CP graphs, of MX graphs and of CE graphs. Decode rows (TG, VF, MX's decode part) keep the
reference: nkilib's decode kernel `attention_tkg` is a sub-kernel that wants q / k already on
chip unless RoPE is fused (attention_tkg.py, 2.29_release l.321-330).

Three sets of rules, each written once below:
- the target's, from NxD Inference, AWS's own caller of the kernel (modules/attention/
  attention_base.py, read Nov 2026): `target_misfit`;
- the installed kernel's limits, its `kernel_assert`s on module constants: `KernelLimits`;
- ours: bf16 (the kernel's tiles), a layer whose cache is a ring keeps the reference
  (nki_kernels.NkiKernels decides that per layer, from the layout).
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import asdict, dataclass
from pathlib import Path

from ...config import NeuronConfig, NeuronConfigError
from ...graphs import GraphKind, GraphSpec
from ...modeling.family import FamilySpec
from ...modeling.parallel import ShardLayout
from .target import TARGETS

KERNEL_MODULE = "nkilib.core.attention.attention_cte"
CHUNK_KINDS = (GraphKind.CP, GraphKind.MX, GraphKind.CE)
# NxD Inference's `get_flash_attention_strategy` (attention_base.py l.985-1034) on LNC1 (trn1,
# inf2): the unsharded kernel from 4096 query tokens by default (l.1027), from 512 when the
# kernel is explicitly enabled (l.1031; docstring: "The unsharded kernel requires a context
# length of at least 512"). We take the explicit-enable threshold, below the 4096 default: a
# chunk of 512 to 4095 tokens gets the kernel NxD Inference accepts for it.
LNC1_MIN_WIDTH = 512


@dataclass(frozen=True)
class KernelLimits:
    """attention_cte's shape limits, as its module constants state them (attention_cte.py:
    2.28 l.130-133, 2.29_release and main l.140-143). The kernel asserts batch (heads of the
    chunk) <= max_batch, prior + active positions and the sliding window <= max_positions,
    head_dim <= max_head_dim. `source`: which kernel file they were read from."""

    max_batch: int
    max_positions: int
    max_head_dim: int
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


# nki-library's 2.28 branch, the strictest published set: used when the installed kernel's
# constants cannot be read.
STRICTEST = KernelLimits(32, 36864, 128, "nki-library 2.28's published limits (installed nkilib unreadable)")


def installed_limits() -> KernelLimits:
    """The limits of the nkilib that imports here (neuronx-cc bundles it; nki-library's own
    package replaces the bundled copy), with the digest of its file; STRICTEST if unreadable."""
    try:
        module = importlib.import_module(KERNEL_MODULE)
        limits = (int(module._MAX_BS), int(module._MAX_SEQLEN), int(module._MAX_HEAD_DIM))
    except Exception:  # a missing module, a stand-in without constants, a renamed constant
        return STRICTEST
    return KernelLimits(*limits, source=_describe(module))


def _describe(module) -> str:
    path = getattr(module, "__file__", None)
    if not path or not Path(path).is_file():
        return f"{KERNEL_MODULE} (no file)"
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return f"attention_cte.py sha256:{digest}"  # the content, not the host's path (cache keys)


def nkilib_missing() -> str | None:
    """Why attention_cte cannot be called on this host, or None (neuronx-cc bundles nkilib)."""
    for module in ("nki", KERNEL_MODULE):
        try:
            importlib.import_module(module)
        except Exception as e:  # an SDK's import can fail in many ways; say which
            return f"{module} does not import ({type(e).__name__}: {e})"
    return None


def target_misfit(instance_type: str, width: int, sinks: bool) -> str | None:
    """NxD Inference's rules for the kernel on the target. LNC2 (trn2): its prefix prefill
    (`perform_prefix_prefill`, l.772) asks for no attention mask, so the sharded kernel serves
    any width. LNC1 (trn1; inf2 shares its NeuronCore-v2 and compile target, by analogy - not
    verified on an inf2): chunks of LNC1_MIN_WIDTH or more, and no sinks (`perform_prefill`
    asserts "sink argument is not supported by trn1", l.714; the prefix path never passes one)."""
    target = TARGETS[instance_type]
    if target.logical_nc_config > 1:
        return None
    if width < LNC1_MIN_WIDTH:
        return (
            f"on {instance_type} the kernel serves chunks of {LNC1_MIN_WIDTH}+ tokens, as NxD Inference "
            f"runs it (pass --prefill-chunk-size {LNC1_MIN_WIDTH} or more)"
        )
    if sinks:
        return f"attention sinks are not supported by the kernel on {instance_type} (NxD Inference)"
    return None


def graph_misfit(
    config: NeuronConfig, spec: FamilySpec, graph: GraphSpec, limits: KernelLimits
) -> str | None:
    """Why `graph` cannot run its prefill chunk through attention_cte, or None."""
    if graph.kind is GraphKind.COPY:
        return "it attends over nothing"
    if graph.kind not in CHUNK_KINDS:
        return "decode rows keep the reference attention"
    if config.dtype != "bfloat16":
        return f"the export is {config.dtype} and the kernel computes in bf16 (pass --dtype bfloat16)"
    misfit = target_misfit(config.instance_type, graph.width, spec.attention_sinks)
    if misfit:
        return misfit
    layout = ShardLayout.of(spec, config.tp_degree)
    heads, kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank
    if not 0 < spec.head_dim <= limits.max_head_dim:
        return f"head_dim {spec.head_dim} is above the kernel's {limits.max_head_dim}"
    if heads > limits.max_batch or heads % kv_heads:
        return f"{heads} query heads over {kv_heads} KV heads a core: the kernel takes at most {limits.max_batch}, a multiple"
    # NkiKernels hands the kernel W - T prior positions and the T active ones (nki_kernels.py)
    if graph.window > limits.max_positions:
        return f"a window of {graph.window} positions exceeds the kernel's {limits.max_positions}"
    windows = [w for w in spec.sliding_windows if w is not None]
    if windows and max(windows) > limits.max_positions:
        return f"a sliding window of {max(windows)} exceeds the kernel's {limits.max_positions}"
    return None


def choose_nki_graphs(
    config: NeuronConfig, spec: FamilySpec, graphs: list[GraphSpec]
) -> tuple[tuple[str, ...], dict[str, str], KernelLimits | None]:
    """(the graphs whose prefill chunks run attention_cte, why each other graph does not, the
    kernel limits that decided). `--attention-kernel nki` refuses, by graph, what cannot run it."""
    mode = config.attention_kernel
    if mode == "reference":
        return (), {g.name: "--attention-kernel reference" for g in graphs}, None
    missing = nkilib_missing()
    limits = installed_limits()
    reasons = {g.name: missing or graph_misfit(config, spec, g, limits) for g in graphs}
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
    why_not = {name: reason for name, reason in reasons.items() if reason is not None}
    return chosen, why_not, None if missing else limits

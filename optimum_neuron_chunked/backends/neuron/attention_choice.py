"""Which graphs of a neuron export attend through AWS's NKI kernel for prefill chunks,
nkilib's `attention_cte` (aws-neuron/nki-library, src/nkilib_src/nkilib/core/attention/
attention_cte.py), decided at export per graph (`--attention-kernel`) and recorded in the
export's config (`NeuronConfig.nki_attention`, `NeuronConfig.nki_limits`).

The kernel takes a chunk of queries over a prior K/V with a runtime prior length: the chunk of
CP graphs, of MX graphs and of CE graphs, and the EAGLE3 head's first pass in DC graphs (over
its CP twin's chunk: the same width and bucket). Decode rows (TG, VF, MX's decode part, the
head's later steps) keep the reference: nkilib's decode kernel `attention_tkg` is a sub-kernel
that wants q / k already on chip unless RoPE is fused (attention_tkg.py, 2.29_release l.321-330).

NkiKernels applies the kernel by (tokens, bucket) shape, so a DC graph runs it wherever its CP
twin does: `graph_misfit` decides a DC graph as its twin, and the twin with the head's
attention (its own query heads, Eagle3Spec.family) checked too, so the record names both.

Rules, each written once below:
- the target's: `target_misfit` (NeuronCore-v2 runs no kernel of the SDKs we admit; trn2 any
  width, as NxD Inference's prefix prefill runs it);
- the installed kernel's limits, its `kernel_assert`s on module constants: `KernelLimits`;
- what the kernel is handed for a chunk: `kernel_prior` (NkiKernels, the probe and the choice);
- ours: bf16 (the kernel's tiles), a layer whose cache is a ring keeps the reference:
  `kernel_layers` (NkiKernels decides that per layer, from the layout).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from packaging.version import InvalidVersion, Version

from ...config import NeuronConfig, NeuronConfigError
from ...graphs import GraphKind, GraphSpec
from ...modeling.family import FamilySpec
from ...modeling.kv_layout import KVLayout
from ...modeling.parallel import ShardLayout
from .sdk import XLA_SDK_SETS
from .target import TARGETS

KERNEL_MODULE = "nkilib.core.attention.attention_cte"
CHUNK_KINDS = (GraphKind.CP, GraphKind.MX, GraphKind.CE, GraphKind.DC)
# Neuron SDK 2.29.0's NxD Inference release notes, Breaking Changes: "NxD Inference no longer
# supports NKI kernels on Trn1/Inf2 hardware, as NKI 0.3.0 kernels are not supported on
# Trn1/Inf2"; the NKI FAQ from 2.29: "NKI supports Trainium2 and Trainium3". Every SDK the
# `neuron` extra admits (sdk.XLA_SDK_SETS: 2.29 on) carries NKI >= 0.3.0.
NEURONCORE_V2 = (
    "NKI >= 0.3.0 (Neuron SDK 2.29+) does not run on NeuronCore-v2 (trn1 / inf2): NxD Inference 2.29 "
    "release notes, Breaking Changes"
)
NKI_FOR_V2 = Version("0.3.0")  # the `nki` distribution: 0.2.0 on SDK 2.28, 0.3.0 on 2.29


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


def installed_nki_version() -> Version | None:
    """The `nki` here: its distribution's version, else the module's __version__; None if neither."""
    try:
        found = importlib.metadata.version("nki")
    except importlib.metadata.PackageNotFoundError:
        try:
            found = importlib.import_module("nki").__version__
        except Exception:  # no nki, a stand-in without a version: nothing to say
            return None
    try:
        return Version(str(found))
    except InvalidVersion:
        return None


def target_misfit(instance_type: str) -> str | None:
    """Why no graph of an export for `instance_type` runs the kernel, or None. NeuronCore-v2
    (trn1, inf2): NEURONCORE_V2. trn2: NxD Inference's prefix prefill (modules/attention/
    attention_base.py `perform_prefix_prefill`, l.772) asks for no attention mask, so the
    sharded kernel serves any width."""
    return NEURONCORE_V2 if TARGETS[instance_type].neuron_core < 3 else None


def refuse_target(instance_type: str) -> NeuronConfigError:
    """--attention-kernel nki for a NeuronCore-v2 target, said with the nki found here."""
    sdks = f"{XLA_SDK_SETS[0].sdk} to {XLA_SDK_SETS[-1].sdk}"
    said = (
        f"--attention-kernel nki: no NKI kernel runs on {instance_type} with the Neuron SDKs this package "
        f"admits ({sdks}): {NEURONCORE_V2}."
    )
    found = installed_nki_version()
    if found is not None and found < NKI_FOR_V2:
        said += (
            f" nki {found} is installed here, an SDK 2.28 release (its kernels ran on trn1 / inf2): SDK 2.28 "
            "is not admitted by the neuron extra."
        )
    return NeuronConfigError(f"{said} Pass --attention-kernel auto or reference.")


def kernel_prior(window: int, tokens: int, start: int | torch.Tensor = 0) -> tuple[int, int | torch.Tensor]:
    """(prior positions, visible base) of a chunk of `tokens` queries starting at `start` (an int,
    or a traced [1] tensor) in a context bucket of `window` positions, as the kernel is handed
    it: the prior is the context's first W - T positions, of which the first
    base = min(start, W - T) are visible; the T active keys are the positions base... W positions
    reach the kernel whatever the start (prior + active <= its max_positions iff W is); W == T
    (CE): no prior."""
    prior = window - tokens
    base = torch.clamp(start, max=prior) if isinstance(start, torch.Tensor) else min(start, prior)
    return prior, base


def kernel_layers(config: NeuronConfig, family: FamilySpec) -> list[int]:
    """The layers that can run the kernel: those whose cache is position-ordered (a ring's
    positions wrap: it keeps the reference, and its window is never the kernel's)."""
    rings = set(KVLayout.of(config, family).ring_layers)
    return [i for i in range(len(family.sliding_windows)) if i not in rings]


def heads_misfit(config: NeuronConfig, family: FamilySpec, limits: KernelLimits) -> str | None:
    """Why the kernel cannot take the attention of `family`'s layers (per rank), or None."""
    layout = ShardLayout.of(family, config.tp_degree)
    heads, kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank
    if not 0 < family.head_dim <= limits.max_head_dim:
        return f"head_dim {family.head_dim} is above the kernel's {limits.max_head_dim}"
    if heads > limits.max_batch or heads % kv_heads:
        return f"{heads} query heads over {kv_heads} KV heads a core: the kernel takes at most {limits.max_batch}, a multiple"
    return None


def graph_misfit(
    config: NeuronConfig,
    family: FamilySpec,
    graph: GraphSpec,
    limits: KernelLimits,
    head: FamilySpec | None = None,
) -> str | None:
    """Why `graph` cannot run its prefill chunk through attention_cte, or None. `head`: the
    EAGLE3 head's layer as a family (Eagle3Spec.family): its DC graphs share every chunk's
    shape (a DC per CP; MX's chunk is a full-width CP's), so a head the kernel cannot take
    keeps every chunk on the reference."""
    if graph.kind is GraphKind.DC:  # the head's first pass, where its CP twin runs the kernel
        return graph_misfit(config, family, replace(graph, kind=graph.kind.draft_twin), limits, head)
    if graph.kind is GraphKind.COPY:
        return "it attends over nothing"
    if graph.kind not in CHUNK_KINDS:
        return "decode rows keep the reference attention"
    if config.dtype != "bfloat16":
        return f"the export is {config.dtype} and the kernel computes in bf16 (pass --dtype bfloat16)"
    if misfit := heads_misfit(config, family, limits):
        return misfit
    if head is not None and (misfit := heads_misfit(config, head, limits)):
        return f"the EAGLE3 head's attention: {misfit} (its DC graphs run the kernel at the chunks' shapes)"
    prior, _ = kernel_prior(graph.window, graph.width)
    if prior + graph.width > limits.max_positions:
        return f"a window of {graph.window} positions exceeds the kernel's {limits.max_positions}"
    sliding = [w for i in kernel_layers(config, family) if (w := family.sliding_windows[i]) is not None]
    if sliding and max(sliding) > limits.max_positions:
        return f"a sliding window of {max(sliding)} exceeds the kernel's {limits.max_positions}"
    return None


def choose_nki_graphs(
    config: NeuronConfig, family: FamilySpec, graphs: list[GraphSpec], head: FamilySpec | None = None
) -> tuple[tuple[str, ...], dict[str, str], KernelLimits | None]:
    """(the graphs whose prefill chunks run attention_cte, why each other graph does not, the
    kernel limits that decided); `head`: the EAGLE3 head's layer as a family (graph_misfit).
    `--attention-kernel nki` refuses, by graph, what cannot run it."""
    mode = config.attention_kernel
    if mode == "reference":
        return (), {g.name: "--attention-kernel reference" for g in graphs}, None
    misfit = target_misfit(config.instance_type)
    if misfit and mode == "nki":
        raise refuse_target(config.instance_type)
    if misfit:  # no kernel is imported or probed for this target
        return (), {g.name: misfit for g in graphs}, None
    missing = nkilib_missing()
    limits = installed_limits()
    reasons = {g.name: missing or graph_misfit(config, family, g, limits, head) for g in graphs}
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

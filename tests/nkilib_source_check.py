"""Our neuron graphs with AWS's attention kernel in them, against nki-library's own source:
stand-ins for `nki` (jit, the grid subscript) make nkilib's `attention_cte` its pure-torch
reference (attention_cte_torch.attention_cte_torch_ref, from NKILIB_SOURCE), and every chunked
graph of a kernel-sized bf16 model (head_dim 128, buckets of 512, chunks of 256) runs eager
with NkiKernels and with the reference attention. Not a pytest module: run it by hand in
.venv-sdk or .venv, once per nki-library branch:

    git clone -b 2.29_release https://github.com/aws-neuron/nki-library /tmp/nkilib-2.29
    python tests/nkilib_source_check.py /tmp/nkilib-2.29

Families whose attention the kernel covers: plain causal (llama, qwen3), sliding windows with
rings and without (gemma3_text, whole-sequence and paged), sinks (gpt_oss), on trn2; trn1 and
inf2 (NeuronCore-v2: no NKI kernel of SDK 2.29+) must choose the reference for every graph. In fp32 (the kernel forced on; the reference computes in fp32) the
graphs must equal the reference attention's within EXACT; in bf16, whose logits differ from
fp32 by bf16's rounding whichever the attention, the kernel's error against fp32 must stay
within SLACK of the reference's. Prints which graphs ran the kernel; exits non-zero on a
larger error or on a chosen graph that did not run the kernel.
"""

from __future__ import annotations

import argparse
import ast
import sys
import types
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from optimum_neuron_chunked.backends.neuron.attention_choice import KERNEL_MODULE  # noqa: E402

KERNEL_SIZED = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=128, vocab_size=512, initializer_range=0.05, tie_word_embeddings=False)  # fmt: skip
FAMILIES = {
    "llama": dict(model_type="llama", num_hidden_layers=2),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2),
    "gemma3_text": dict(
        model_type="gemma3_text",
        num_hidden_layers=3,
        sliding_window=300,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),  # fmt: skip
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_hidden_layers=2,
        sliding_window=300,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=128,
    ),  # fmt: skip
}
SHAPES = dict(batch_size=2, sequence_length=1024, context_buckets=(512, 1024), mixed_step=True, dtype="bfloat16",
              backend="neuron")  # fmt: skip
# (instance type, paged, chunk): trn2 runs the kernel at any width; trn1 / inf2 at none
RUNS = (("trn1", False, 512), ("inf2", False, 512), ("trn2", True, 256), ("trn2", False, 512))
PAGED = dict(kv_cache_blocks=16, kv_block_size=128)
# bf16 graphs with the kernel are as accurate as with the reference attention: their largest
# logit error against the fp32 reference, relative to the logits' magnitude, within this factor.
SLACK = 1.5
EXACT = 1e-4  # fp32 graphs, the kernel's reference in fp32 too: one computation, two orders


def error(outputs: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    return max(float((o - t).abs().max() / t.abs().max()) for o, t in zip(outputs, truth, strict=True))


class RecordingKernel:
    """nki.jit(kernel) called as it is or with a grid: nkilib's torch reference, its result in
    q's dtype (the kernel's), each call counted for the graph running."""

    graph = ""

    def __init__(self, reference):
        self.reference, self.graphs = reference, set()

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        self.graphs.add(RecordingKernel.graph)
        kwargs.pop("mm_out_dtype", None)
        return self.reference(*args, **kwargs).to(args[0].dtype)


def install_stand_ins(source: Path) -> RecordingKernel:
    """`nki` and attention_cte's module as stand-ins: the torch reference as the kernel, the
    kernel file's own limit constants (read from its source: it imports closed `nki` modules)."""
    sys.path.insert(0, str(source / "src" / "nkilib_src"))
    from nkilib.core.attention.attention_cte_torch import attention_cte_torch_ref

    kernel = RecordingKernel(attention_cte_torch_ref)
    nki = types.ModuleType("nki")
    nki.jit = lambda fn: kernel
    module = types.ModuleType(KERNEL_MODULE)
    module.attention_cte = attention_cte_torch_ref
    module.__dict__.update(limit_constants(source / "src/nkilib_src/nkilib/core/attention/attention_cte.py"))
    sys.modules["nki"], sys.modules[KERNEL_MODULE] = nki, module
    return kernel


def limit_constants(kernel_file: Path) -> dict[str, int]:
    """_MAX_BS, _MAX_SEQLEN, _MAX_HEAD_DIM as the kernel file assigns them."""
    names = ("_MAX_BS", "_MAX_SEQLEN", "_MAX_HEAD_DIM")
    tree = ast.parse(kernel_file.read_text())
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in names
    }


def long_context_choice() -> str:
    """A trn2 Llama-3.1-8B bf16 export at a 131072 bucket (tp 8): which graphs get the kernel."""
    from transformers import LlamaConfig

    from optimum_neuron_chunked.backends.neuron.attention_choice import choose_nki_graphs
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.graphs import graph_specs
    from optimum_neuron_chunked.modeling import family_spec

    spec = family_spec(LlamaConfig(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096,
                                   max_position_embeddings=131072))  # fmt: skip
    config = NeuronConfig(batch_size=8, sequence_length=131072, prefill_chunk_size=512, dtype="bfloat16",
                          backend="neuron", instance_type="trn2", tp_degree=8)  # fmt: skip
    chosen, reasons, limits = choose_nki_graphs(config, spec, graph_specs(config))
    return f"kernel in {', '.join(chosen) or 'no graph'}; cp_w131072: {reasons.get('cp_w131072', 'kernel')} ({limits})"


def family_config(family: str, instance_type: str, paged: bool, chunk: int):
    """(HF config, NeuronConfig as the export chooses its kernel graphs)."""
    from transformers import AutoConfig

    from optimum_neuron_chunked.backends.neuron.attention_choice import choose_nki_graphs
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.graphs import graph_specs
    from optimum_neuron_chunked.modeling import family_spec

    fields = {**KERNEL_SIZED, **FAMILIES[family]}
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    widths = dict(prefill_chunk_size=chunk, prefill_widths=(chunk // 2, chunk))
    config = NeuronConfig(**SHAPES, **widths, instance_type=instance_type, **(PAGED if paged else {}))
    chosen, reasons, _ = choose_nki_graphs(config, family_spec(hf_config), graph_specs(config))
    return hf_config, replace(config, nki_attention=chosen), reasons


def reference_only(family: str, instance_type: str, paged: bool, chunk: int) -> str | None:
    """NeuronCore-v2: why every graph keeps the reference (the same reason each), None if one did not."""
    from optimum_neuron_chunked.backends.neuron.attention_choice import NEURONCORE_V2
    from optimum_neuron_chunked.backends.neuron.backend import NeuronBackend
    from optimum_neuron_chunked.modeling.kernels import Kernels

    _, config, reasons = family_config(family, instance_type, paged, chunk)
    plain = type(NeuronBackend().kernels(config)) is Kernels
    return NEURONCORE_V2 if plain and set(reasons.values()) == {NEURONCORE_V2} else None


def runners(family: str, instance_type: str, paged: bool, chunk: int):
    """(config, GraphRunners of one kernel-sized model: fp32 reference, fp32 with the kernel,
    bf16 reference, bf16 with the kernel). The same weights (bf16 values) in each."""
    from transformers import AutoModelForCausalLM

    from optimum_neuron_chunked.backends.neuron.backend import NeuronBackend
    from optimum_neuron_chunked.graph_runner import GraphRunner
    from optimum_neuron_chunked.graphs import graph_module, graph_specs
    from optimum_neuron_chunked.modeling import build_model
    from optimum_neuron_chunked.modeling.kernels import Kernels

    hf_config, config, _ = family_config(family, instance_type, paged, chunk)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    fp32 = replace(config, dtype="float32")
    out = []
    backend = NeuronBackend()
    for cfg, kernels in (
        (fp32, Kernels()),
        (fp32, backend.kernels(fp32)),
        (config, Kernels()),
        (config, backend.kernels(config)),
    ):
        model = build_model(hf_config, cfg, kernels=kernels)
        dtype = getattr(torch, cfg.dtype)
        model.load_weights({k: v.to(dtype) for k, v in model.weights_from_hf(hf).items()})
        graphs = {s.name: recording(s.name, graph_module(model.eval(), s, cfg)) for s in graph_specs(cfg)}
        out.append(GraphRunner(cfg, graphs))
    return config, out


def recording(name: str, graph):
    def run(*inputs):
        RecordingKernel.graph = name
        return graph(*inputs)

    return run


def steps(config, runner) -> list[torch.Tensor]:
    """Chunks of both CP widths, full and padded, and MX steps, in both buckets: every chunked
    graph runs (each output compared)."""
    chunk = config.prefill_chunk_size
    ids = torch.randint(4, 500, (900,), generator=torch.Generator().manual_seed(1))
    other_ids = torch.randint(4, 500, (1024,), generator=torch.Generator().manual_seed(2))
    paged = bool(config.kv_cache_blocks)
    blocks, other = (list(range(8)), list(range(8, 16))) if paged else ([0], [1])
    sampling = (torch.ones(1, 3), torch.zeros(1))
    outs = []

    def mixed(position: int, start: int) -> None:
        step = runner.decode_with_chunk(
            ids[position : position + 1], torch.tensor([position]), [blocks], sampling,
            other_ids[start : start + chunk], start, other,
        )  # fmt: skip
        outs.extend([step[1][0].float(), step[2].float()])

    with torch.no_grad():
        mixed(0, 0)  # mx_w512
        # both widths in both buckets; chunks starting past W - C (at 300 for C 256, 100 for C 512)
        ends = (100, 300 if chunk <= 256 else 400, 512, 512 + chunk * 3 // 5, 850, 899)
        for start, end in zip((1, *ends[:-1]), ends, strict=True):
            outs.append(runner.prefill(ids[start:end], start, blocks).float())
        mixed(899, 1024 - chunk)  # mx_w1024
    return outs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("nkilib_source", type=Path, help="a checkout of github.com/aws-neuron/nki-library")
    args = parser.parse_args(argv)
    from optimum_neuron_chunked.backends.neuron.target import TARGETS

    kernel = install_stand_ins(args.nkilib_source)
    failures = 0
    for family in FAMILIES:
        for instance_type, paged, chunk in RUNS:
            layout = "paged" if paged else "whole-sequence"
            if TARGETS[instance_type].neuron_core < 3:
                why = reference_only(family, instance_type, paged, chunk)
                failures += why is None
                print(f"{'ok  ' if why else 'FAIL'} {family:12} {layout:15} {instance_type} C {chunk}: the "
                      f"reference in every graph ({why or 'a graph chose the kernel, or for another reason'})")  # fmt: skip
                continue
            config, runs = runners(family, instance_type, paged, chunk)
            truth, reference = steps(config, runs[0]), steps(config, runs[2])
            kernel.graphs.clear()
            exact = error(steps(config, runs[1]), truth)
            with_kernel = steps(config, runs[3])
            ref_error, kernel_error = (error(x, truth) for x in (reference, with_kernel))
            ran = set(kernel.graphs)
            ok = exact <= EXACT and kernel_error <= SLACK * ref_error and ran == set(config.nki_attention)
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {family:12} {layout:15} {instance_type} C {chunk}: fp32 kernel / reference "
                  f"{exact:.1e}; bf16 against fp32 {kernel_error:.4f} with the kernel, {ref_error:.4f} with the "
                  f"reference; kernel ran in {', '.join(sorted(ran)) or 'no graph'}")  # fmt: skip
    print(f"Llama-3.1-8B, trn2, bucket 131072: {long_context_choice()}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

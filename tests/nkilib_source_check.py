"""Our neuron graphs with AWS's attention kernel in them, against nki-library's own source:
stand-ins for `nki` (jit, the grid subscript) make nkilib's `attention_cte` its pure-torch
reference (attention_cte_torch.attention_cte_torch_ref, from NKILIB_SOURCE), and every chunked
graph of a kernel-sized bf16 model (head_dim 128, buckets of 512, chunks of 256) runs eager
with NkiKernels and with the reference attention. Not a pytest module: run it by hand in
.venv-sdk or .venv, once per nki-library branch:

    git clone -b 2.29_release https://github.com/aws-neuron/nki-library /tmp/nkilib-2.29
    python tests/nkilib_source_check.py /tmp/nkilib-2.29 [--eagle3: the EAGLE3 runs alone]

Families whose attention the kernel covers: plain causal (llama, qwen3), sliding windows with
rings and without (gemma3_text, whole-sequence and paged), sinks (gpt_oss), on trn2; trn1 and
inf2 (NeuronCore-v2: no NKI kernel of SDK 2.29+) must choose the reference for every graph. In fp32 (the kernel forced on; the reference computes in fp32) the
graphs must equal the reference attention's within EXACT; in bf16, whose logits differ from
fp32 by bf16's rounding whichever the attention, the kernel's error against fp32 must stay
within SLACK of the reference's. Prints which graphs ran the kernel; exits non-zero on a
larger error or on a chosen graph that did not run the kernel.

EAGLE3 (--speculation-head): NkiKernels picks the kernel by a chunk's (tokens, bucket), so a DC
graph's first pass (the head's one layer over the chunk's rows: not decode rows, one row, a
position-ordered layer) runs attention_cte wherever the CP graph of its width and bucket was
chosen; DV and the recurrent steps are decode rows (the reference). For llama and qwen3 with a
random kernel-sized head (head_dim 128, the target's heads, a smaller draft vocabulary), on trn2
paged and whole-sequence: chunks of both widths in both buckets each followed by their drafts,
then a verify step and its drafts. The head's first-pass outputs (and the target's logits) are
compared as above (fp32: within EXACT and the same drafts; bf16: within SLACK of the
reference's error), and the kernel must run in exactly the chosen CP graphs and the DC graphs
of their shapes.
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
K = 3  # EAGLE3 drafts a step
# A random EAGLE3 head of the kernel-sized targets: their attention shape, head_dim 128 (its own
# hidden // heads is 64: kernel_sized_head shapes its projections), draft vocabulary < vocabulary
HEAD_SIZED = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=256, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_hidden_layers=1, vocab_size=512,
                  draft_vocab_size=384, rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10000.0,
                  eagle_aux_hidden_state_layer_ids=[0, 1, 2])  # fmt: skip
HEAD_FIELDS = dict(mixed_step=False, speculation_length=K, speculation_head="random-head",
                   speculation_head_shares=("embed_tokens",))  # fmt: skip
HEAD_FAMILIES = ("llama", "qwen3")
HEAD_RUNS = (("trn2", True, 256), ("trn2", False, 512))


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


def family_config(family: str, instance_type: str, paged: bool, chunk: int, head: bool = False):
    """(HF config, NeuronConfig as the export chooses its kernel graphs); `head`: with the random
    EAGLE3 head (HEAD_FIELDS)."""
    from transformers import AutoConfig

    from optimum_neuron_chunked.backends.neuron.attention_choice import choose_nki_graphs
    from optimum_neuron_chunked.config import NeuronConfig
    from optimum_neuron_chunked.graphs import graph_specs
    from optimum_neuron_chunked.modeling import family_spec

    fields = {**KERNEL_SIZED, **FAMILIES[family]}
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    widths = dict(prefill_chunk_size=chunk, prefill_widths=(chunk // 2, chunk))
    shapes = SHAPES | (HEAD_FIELDS if head else {})
    config = NeuronConfig(**shapes, **widths, instance_type=instance_type, **(PAGED if paged else {}))
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


def kernel_sized_head(seed: int) -> dict[str, torch.Tensor]:
    """HEAD_SIZED's tensors as a checkpoint names them, bf16 values (the targets' are bf16)."""
    from optimum_neuron_chunked.testing.random_heads import random_head

    tensors = random_head(HEAD_SIZED, seed)  # its attention hidden // heads wide: reshaped here
    g = torch.Generator().manual_seed(seed + 1)
    h, d = HEAD_SIZED["hidden_size"], HEAD_SIZED["head_dim"]
    q, kv = HEAD_SIZED["num_attention_heads"] * d, HEAD_SIZED["num_key_value_heads"] * d
    for name, shape in (
        ("q_proj", (q, 2 * h)),
        ("k_proj", (kv, 2 * h)),
        ("v_proj", (kv, 2 * h)),
        ("o_proj", (h, q)),
    ):
        tensors[f"midlayer.self_attn.{name}.weight"] = torch.randn(shape, generator=g) * shape[1] ** -0.5
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}


class HeadOutputs:
    """The head's first-pass output [1, R, H] of each DC / DV call (its first call in a graph call)."""

    def __init__(self):
        self.outs, self.first = [], False

    def __call__(self, module, args, output):
        if self.first:
            self.outs.append(output[0].float().clone())
            self.first = False


def runners(family: str, instance_type: str, paged: bool, chunk: int, head: bool = False):
    """(config, GraphRunners of one kernel-sized model: fp32 reference, fp32 with the kernel,
    bf16 reference, bf16 with the kernel). The same weights (bf16 values) in each. `head`: with
    the random EAGLE3 head (then each runner has `head_outputs`, a HeadOutputs)."""
    from transformers import AutoModelForCausalLM

    from optimum_neuron_chunked.backends.neuron.backend import NeuronBackend
    from optimum_neuron_chunked.graph_runner import GraphRunner
    from optimum_neuron_chunked.graphs import graph_module, graph_specs
    from optimum_neuron_chunked.modeling import build_model
    from optimum_neuron_chunked.modeling.kernels import Kernels

    hf_config, config, _ = family_config(family, instance_type, paged, chunk, head)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    fp32 = replace(config, dtype="float32")
    eagle3, head_state = None, None
    if head:  # as export/pipeline.py reads a head (head_checkpoint.fitting_spec, head_weights)
        from optimum_neuron_chunked.head_checkpoint import HeadCheckpoint, fitting_spec, head_weights
        from optimum_neuron_chunked.modeling import family_spec

        eagle3 = fitting_spec(HEAD_SIZED, config, family_spec(hf_config))
        head_state = head_weights(
            HeadCheckpoint(Path("random-head"), HEAD_SIZED, kernel_sized_head(7)), eagle3
        )
    out = []
    backend = NeuronBackend()
    for cfg, kernels in (
        (fp32, Kernels()),
        (fp32, backend.kernels(fp32)),
        (config, Kernels()),
        (config, backend.kernels(config)),
    ):
        model = build_model(hf_config, cfg, kernels=kernels, eagle3=eagle3)
        dtype = getattr(torch, cfg.dtype)
        # the head's d2t stays int64, its rotary float32 (eagle3.attach_head)
        weights = model.weights_from_hf(hf, head=head_state).items()
        model.load_weights({k: v.to(dtype) if castable(k, v) else v for k, v in weights})
        outputs = HeadOutputs() if head else None
        if head:
            model.draft.register_forward_hook(outputs)
        graphs = {
            s.name: recording(s.name, graph_module(model.eval(), s, cfg), outputs) for s in graph_specs(cfg)
        }
        runner = GraphRunner(cfg, graphs)
        runner.head_outputs = outputs
        out.append(runner)
    return config, out


def castable(name: str, tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not name.startswith("draft.rotary_emb.")


def recording(name: str, graph, head_outputs: HeadOutputs | None = None):
    def run(*inputs):
        RecordingKernel.graph = name
        if head_outputs is not None:
            head_outputs.first = True
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


def head_steps(config, runner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the target's logits, the drafts) of chunks of both CP widths in both buckets, each
    followed by its DC call, then one verify row (fixed tokens, whatever was drafted) and its DV
    call; the head's first-pass outputs land in runner.head_outputs."""
    chunk = config.prefill_chunk_size
    ids = torch.randint(4, 500, (1024,), generator=torch.Generator().manual_seed(1))
    blocks = list(range(8)) if config.kv_cache_blocks else [0]
    outs, drafts = [], []
    with torch.no_grad():
        ends = (100, 300 if chunk <= 256 else 400, 512, 512 + chunk * 3 // 5, 850, 899)
        for start, end in zip((0, *ends[:-1]), ends, strict=True):
            outs.append(runner.prefill(ids[start:end], start, blocks).float())
            drafts.append(runner.draft_after_chunk(ids[start:end], int(ids[end]), start))
        _, logits = runner.verify([ids[899 : 900 + K]], torch.tensor([899]), [blocks])
        outs.append(logits[0].float())
        drafts.append(runner.draft_after_verify(runner.last_verify, [int(ids[900 + K])], [K])[0])
    return outs, drafts


def head_kernel_graphs(config) -> set[str]:
    """The graphs that must run the kernel: the chosen ones and the DC graphs of their shapes
    (NkiKernels: by (tokens, bucket) of a chunk part)."""
    from optimum_neuron_chunked.graphs import GraphKind, graph_specs

    specs = graph_specs(config)
    shapes = {(s.width, s.window) for s in specs if s.name in config.nki_attention}
    return set(config.nki_attention) | {
        s.name for s in specs if s.kind is GraphKind.DC and (s.width, s.window) in shapes
    }


def check_head(kernel: RecordingKernel, family: str, instance_type: str, paged: bool, chunk: int) -> bool:
    config, runs = runners(family, instance_type, paged, chunk, head=True)
    results, ran_by_run = [], []
    for runner in runs:
        kernel.graphs.clear()
        outs, drafts = head_steps(config, runner)
        results.append((outs, runner.head_outputs.outs, drafts))
        ran_by_run.append(set(kernel.graphs))
    (truth, truth_head, truth_drafts), fp32_kernel, reference, with_kernel = results
    exact = max(error(fp32_kernel[0], truth), error(fp32_kernel[1], truth_head))
    same_drafts = [d.tolist() for d in fp32_kernel[2]] == [d.tolist() for d in truth_drafts]
    ref_error, kernel_error = (error(x[0], truth) for x in (reference, with_kernel))
    ref_head, kernel_head = (error(x[1], truth_head) for x in (reference, with_kernel))
    ran, expected = ran_by_run[3], head_kernel_graphs(config)
    ok = (
        exact <= EXACT
        and same_drafts
        and kernel_error <= SLACK * ref_error
        and kernel_head <= SLACK * ref_head
        and ran == ran_by_run[1] == expected
        and not ran_by_run[0] | ran_by_run[2]
    )
    layout = "paged" if paged else "whole-sequence"
    head_graphs = sorted(n for n in ran if n.startswith("dc"))
    recorded = set(head_graphs) <= set(config.nki_attention)  # the export's record names them
    ok = ok and recorded
    print(f"{'ok  ' if ok else 'FAIL'} {family:12} eagle3 {layout:15} {instance_type} C {chunk}: fp32 kernel / reference "
          f"{exact:.1e}, drafts {'equal' if same_drafts else 'DIFFER'}; bf16 against fp32: the head's first pass "
          f"{kernel_head:.4f} with the kernel, {ref_head:.4f} with the reference (target {kernel_error:.4f} / "
          f"{ref_error:.4f}); kernel ran in {', '.join(sorted(ran - set(head_graphs)))} and the head's "
          f"{', '.join(head_graphs) or 'no graph'} ({'in' if recorded else 'MISSING from'} nki_attention)"
          + ("" if ran == expected else f"; expected {sorted(expected)}"))  # fmt: skip
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("nkilib_source", type=Path, help="a checkout of github.com/aws-neuron/nki-library")
    parser.add_argument("--eagle3", action="store_true", help="the EAGLE3 head's runs alone")
    args = parser.parse_args(argv)
    from optimum_neuron_chunked.backends.neuron.target import TARGETS

    kernel = install_stand_ins(args.nkilib_source)
    failures = 0
    for family in HEAD_FAMILIES:
        for instance_type, paged, chunk in HEAD_RUNS:
            failures += not check_head(kernel, family, instance_type, paged, chunk)
    if args.eagle3:
        return 1 if failures else 0
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

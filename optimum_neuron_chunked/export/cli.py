"""`optimum-cli export neuron` and `python -m optimum_neuron_chunked.export`: one parser, one entry point."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

from optimum_neuron_chunked.config import BACKENDS, DTYPES, NeuronConfig

# Choices and defaults come from the config: declared once there.
DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(NeuronConfig) if f.default is not dataclasses.MISSING
}
INSTANCE_TYPES = ("trn1", "inf2", "trn2")  # backends/neuron/target.py TARGETS

EPILOG = (
    "Chunked export (CP + TG graphs):  --prefill-chunk-size 128\n"
    "Standard export (CE + TG graphs): omit --prefill-chunk-size (or pass 0)"
)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", required=True, help="HF model id or local checkpoint folder.")
    parser.add_argument(
        "--batch_size",
        "--batch-size",
        type=int,
        required=True,
        help="KV-cache slots (max concurrent sequences).",
    )
    parser.add_argument(
        "--sequence_length", "--sequence-length", type=int, required=True, help="Max tokens per sequence."
    )
    parser.add_argument(
        "--prefill-chunk-size",
        "--prefill_chunk_size",
        type=int,
        default=DEFAULTS["prefill_chunk_size"],
        dest="prefill_chunk_size",
        help="Width C of the chunked-prefill graph; 0 (default) compiles the standard context-encoding graph.",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="What the graphs compile for (default: neuron where the Neuron SDK is importable, else cpu).",
    )
    parser.add_argument("--dtype", "--torch_dtype", choices=DTYPES, default=DEFAULTS["dtype"])
    parser.add_argument(
        "--no-on-device-sampling",
        action="store_false",
        dest="on_device_sampling",
        help="TG graphs return logits only; sampling happens on the host.",
    )
    parser.add_argument(
        "--prompt-logprobs",
        "--prompt_logprobs",
        action="store_true",
        dest="prompt_logprobs",
        help="Prefill graphs return every position's logits, so vLLM can serve prompt_logprobs "
        "(evaluation harnesses); costs a [C, V] (chunked) or [P, V] (standard) output per call.",
    )
    parser.add_argument(
        "--tensor_parallel_size",
        "--tensor-parallel-size",
        type=int,
        default=DEFAULTS["tp_degree"],
        dest="tp_degree",
    )
    parser.add_argument(
        "--instance_type",
        "--instance-type",
        choices=INSTANCE_TYPES,
        default=None,
        help="Neuron backend: the instance the graphs are compiled for (default: this host's).",
    )
    parser.add_argument(
        "--max-topk",
        "--max_topk",
        type=int,
        default=DEFAULTS["max_topk"],
        dest="max_topk",
        help="Candidates considered by on-device sampling.",
    )
    parser.add_argument(
        "--context-buckets",
        "--context_buckets",
        type=int_list,
        default=(),
        dest="context_buckets",
        help="Comma-separated context buckets (default: sequence_length halved down to 512).",
    )
    parser.add_argument(
        "--prefill-widths",
        "--prefill_widths",
        type=int_list,
        default=(),
        dest="prefill_widths",
        help="Comma-separated CP graph widths, the chunk size the largest (default: the chunk size "
        "alone). A chunk runs in the narrowest that holds it: short chunks (a prompt's last, a "
        "prefix-cache hit's suffix) cost less, each width adds one graph per context bucket.",
    )
    parser.add_argument(
        "--decode-widths",
        "--decode_widths",
        type=int_list,
        default=(),
        dest="decode_widths",
        help="Comma-separated TG graph widths in rows, the batch size the largest (default: the batch "
        "size alone). A decode step runs in the narrowest that holds its rows: steps with few running "
        "requests cost less, each width adds one graph per context bucket.",
    )
    parser.add_argument(
        "--mixed-step",
        "--mixed_step",
        action="store_true",
        dest="mixed_step",
        help="With --prefill-chunk-size: add an MX graph per context bucket that runs a step's decodes "
        "and a full prefill chunk in one call, reading every weight once for both (default: off; "
        "decodes and chunks run in their own TG and CP calls).",
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty OUT folder.")
    parser.add_argument("output", help="Output folder.")


def int_list(text: str) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024), for argparse (which prints the error with the flag)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def run_export(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from optimum_neuron_chunked.backends import BackendUnavailableError
    from optimum_neuron_chunked.config import NeuronConfigError
    from optimum_neuron_chunked.modeling import UnsupportedArchitectureError

    from .pipeline import ExportError, export

    console = Console(stderr=True)
    try:
        export(
            args.model,
            args.output,
            batch_size=args.batch_size,
            sequence_length=args.sequence_length,
            prefill_chunk_size=args.prefill_chunk_size,
            backend=args.backend,
            dtype=args.dtype,
            on_device_sampling=args.on_device_sampling,
            prompt_logprobs=args.prompt_logprobs,
            tp_degree=args.tp_degree,
            instance_type=args.instance_type,
            max_topk=args.max_topk,
            context_buckets=args.context_buckets,
            prefill_widths=args.prefill_widths,
            decode_widths=args.decode_widths,
            mixed_step=args.mixed_step,
            overwrite=args.overwrite,
            console=console,
        )
    except (ExportError, NeuronConfigError, UnsupportedArchitectureError, BackendUnavailableError) as e:
        console.print(f"[red]error[/]: {escape(str(e))}")
        return 2
    return 0


class NeuronExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="neuron", help="Export a causal LM to chunked-prefill (or standard) graphs.")

    @staticmethod
    def parse_args(parser: argparse.ArgumentParser) -> None:
        parser.epilog = EPILOG
        add_export_arguments(parser)

    def run(self) -> None:
        code = run_export(self.args)
        if code:
            sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m optimum_neuron_chunked.export",
        description=NeuronExportCommand.COMMAND.help,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_export_arguments(parser)
    return run_export(parser.parse_args(argv))

"""`optimum-cli export neuron` and `python -m optimum_neuron_chunked.export`: one parser, one entry point."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

from optimum_neuron_chunked.config import EXPORT_OPTIONS
from optimum_neuron_chunked.config import INSTANCE_TYPES as INSTANCE_TYPES  # tests/test_neuron_backend.py

EPILOG = (
    "Chunked export (CP + TG graphs):  --prefill-chunk-size 128\n"
    "Standard export (CE + TG graphs): omit --prefill-chunk-size (or pass 0)"
)


def int_list(text: str) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024), for argparse (which prints the error with the flag)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def str_list(text: str) -> tuple[str, ...]:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj')."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


# Field annotations (strings: config.py postpones them) -> argparse's `type`.
PARSERS = {"int": int, "str": str, "tuple[int, ...]": int_list, "tuple[str, ...]": str_list}


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """export()'s own arguments around NeuronConfig's export options (config.EXPORT_OPTIONS)."""
    parser.add_argument("--model", "-m", required=True, help="HF model id or local checkpoint folder.")
    for option in EXPORT_OPTIONS:
        parser.add_argument(*option.metadata["flags"], **argument(option))
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty OUT folder.")
    parser.add_argument("output", help="Output folder.")


def argument(option: dataclasses.Field) -> dict:
    """add_argument's keywords for a config field declared with config.option."""
    meta = option.metadata
    kwargs = {"dest": option.name, "help": meta["help"]}
    if option.default is dataclasses.MISSING:
        return kwargs | {"type": PARSERS[option.type], "required": True}
    if isinstance(option.default, bool):
        return kwargs | {"action": "store_false" if option.default else "store_true"}
    default = None if meta["resolved"] else option.default
    if option.type == "tuple[str, ...]" and not meta["comma_list"]:
        return kwargs | {"nargs": "+", "default": default, "metavar": "PATTERN"}
    return kwargs | {"type": PARSERS[option.type], "choices": meta["choices"], "default": default}


def run_export(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from optimum_neuron_chunked.backends import BackendUnavailableError
    from optimum_neuron_chunked.config import NeuronConfigError
    from optimum_neuron_chunked.modeling import UnsupportedArchitectureError

    from .pipeline import ExportError, export

    console = Console(stderr=True)
    try:
        options = {option.name: getattr(args, option.name) for option in EXPORT_OPTIONS}
        export(args.model, args.output, overwrite=args.overwrite, console=console, **options)
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

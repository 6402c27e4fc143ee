"""`optimum-cli export neuron`, beside another package's `export neuron`.

Picked up by optimum-cli from the `optimum.commands.register` namespace (PEP 420, no __init__.py).
optimum 2.0-2.3 (optimum/commands/optimum_cli.py `load_optimum_namespace_cli_commands`) imports
each module of the namespace - folders in `set()` order, files in directory order, so either
package may come first - reads its REGISTER_COMMANDS at once, then `main` adds every command to
argparse in that order (optimum/commands/base.py `BaseOptimumCLICommand.__init__` ->
`subparsers.add_parser(name)`). Python 3.11's argparse refuses a second subparser of one name
(`_SubParsersAction.add_parser`: "conflicting subparser: neuron"), and optimum-neuron 0.4.5
registers `export neuron` too where torch-neuronx is installed (optimum/commands/register/
register_export.py, `NeuronxExportCommand`, whose run() re-reads sys.argv[3:]). So, with one
`export neuron` in the end:

- a neighbour's `export neuron` not yet collected when this module is imported moves from its
  module's REGISTER_COMMANDS into this one, ahead of ours: the neighbour always registers first;
- ours, finding the name taken, puts a dispatching parser under it: the arguments go to ours when
  they hold an option only ours has (--prefill-chunk-size, --backend, ...), to the neighbour's
  otherwise, so its documented commands run unchanged; `--help` alone shows both.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optimum.commands.base import CommandInfo
from optimum.commands.export.base import ExportCommand

from optimum_neuron_chunked.export.cli import NeuronExportCommand

NAMESPACE = "optimum.commands.register"
NAME = NeuronExportCommand.COMMAND.name
HELP_OPTIONS = ("-h", "--help")


def is_export_neuron(entry: Any) -> bool:
    """A REGISTER_COMMANDS entry that adds `export neuron`."""
    command, parent = entry if isinstance(entry, tuple) else (entry, None)
    info = command if isinstance(command, CommandInfo) else getattr(command, "COMMAND", None)
    return (
        isinstance(parent, type) and issubclass(parent, ExportCommand) and getattr(info, "name", None) == NAME
    )


def claim_neighbour_exports() -> list[Any]:
    """The `export neuron` entries of namespace modules optimum-cli has not collected yet, taken out
    of their modules' REGISTER_COMMANDS (returned in namespace order)."""
    spec = importlib.util.find_spec(NAMESPACE)
    claimed = []
    for folder in dict.fromkeys(spec.submodule_search_locations if spec else ()):
        if not Path(folder).is_dir():
            continue  # an editable install's path-hook entry
        for file in sorted(Path(folder).glob("*.py")):
            name = f"{NAMESPACE}.{file.stem}"
            # optimum-cli reads a module's list right after importing it: imported means collected.
            if name == __name__ or name in sys.modules:
                continue
            try:
                module = importlib.import_module(name)
            except Exception:
                continue  # optimum-cli imports it again and reports its own failure
            commands = list(getattr(module, "REGISTER_COMMANDS", None) or ())
            theirs = [entry for entry in commands if is_export_neuron(entry)]
            if theirs:
                module.REGISTER_COMMANDS = [entry for entry in commands if not is_export_neuron(entry)]
                claimed += theirs
    return claimed


def our_only_options(ours: argparse.ArgumentParser, theirs: argparse.ArgumentParser) -> frozenset[str]:
    # argparse lists a parser's option strings nowhere public; this mapping has existed since 2.7.
    return frozenset(ours._option_string_actions) - frozenset(theirs._option_string_actions)


def routes_to_ours(args: Sequence[str], only_ours: frozenset[str]) -> bool:
    """Whether the command line holds an option of ours the neighbour lacks (`--opt` or `--opt=v`)."""
    for arg in args:
        if arg == "--":
            return False
        if arg.split("=", 1)[0] in only_ours:
            return True
    return False


class NeuronExportDispatch(argparse.ArgumentParser):
    """What argparse finds under `export neuron` when two packages register it."""

    def __init__(self, ours: argparse.ArgumentParser, theirs: argparse.ArgumentParser) -> None:
        super().__init__(prog=ours.prog, add_help=False)
        self.ours, self.theirs = ours, theirs
        self.only_ours = our_only_options(ours, theirs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # argparse's _SubParsersAction.__call__ (3.11) hands a subcommand's arguments to this method.
        args = list(sys.argv[1:] if args is None else args)
        if routes_to_ours(args, self.only_ours):
            return self.ours.parse_known_args(args, namespace)
        if any(arg in HELP_OPTIONS for arg in args[: args.index("--") if "--" in args else None]):
            self.print_help()
            self.exit()
        return self.theirs.parse_known_args(args, namespace)

    def format_help(self) -> str:
        rule = "-" * 72
        return (
            f"Two packages register `{self.prog}`. A command line holding an option only\n"
            "optimum-neuron-chunked has (--prefill-chunk-size, --backend, ...) runs its export:\n"
            "for its standard export pass --prefill-chunk-size 0 or --backend; `python -m optimum_neuron_chunked.export`\n"
            "always runs it. Any other command line runs the other package's export (e.g.\n"
            "optimum-neuron's), as it does without optimum-neuron-chunked.\n\n"
            f"{rule}\noptimum-neuron-chunked:\n{rule}\n{self.ours.format_help()}\n"
            f"{rule}\nthe other `export neuron`:\n{rule}\n{self.theirs.format_help()}"
        )


class NeuronChunkedExportCommand(NeuronExportCommand):
    """Our `export neuron`, registered next to a neighbour's if one registered first."""

    def __init__(
        self,
        subparsers: Any,
        args: argparse.Namespace | None = None,
        command: CommandInfo | None = None,
        from_defaults_factory: bool = False,
        parser: argparse.ArgumentParser | None = None,
    ) -> None:
        theirs = None if from_defaults_factory or subparsers is None else subparsers.choices.get(NAME)
        if theirs is None:
            super().__init__(subparsers, args, command, from_defaults_factory, parser)
            return
        # Our parser is built on subparsers of our own (same prog), then the dispatcher takes the
        # name: `choices` is the action's name -> parser map that argparse looks the name up in.
        aside = argparse.ArgumentParser(add_help=False).add_subparsers(prog=theirs.prog.rsplit(" ", 1)[0])
        super().__init__(aside, args, command, from_defaults_factory, parser)
        subparsers.choices[NAME] = NeuronExportDispatch(self.parser, theirs)


REGISTER_COMMANDS = [*claim_neighbour_exports(), (NeuronChunkedExportCommand, ExportCommand)]

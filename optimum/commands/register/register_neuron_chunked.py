# Picked up by optimum-cli from the `optimum.commands.register` namespace (PEP 420, no __init__.py).
from optimum.commands.export.base import ExportCommand

from exporters.cli import NeuronExportCommand

REGISTER_COMMANDS = [(NeuronExportCommand, ExportCommand)]

"""Neuron backend: the graph set compiled with neuronx-distributed's ModelBuilder.

Written against neuronx-distributed 0.18 (Neuron SDK 2.29, `ModelBuilder` of
trace/model_builder_v2.py and `NxDModel`), the last public source; 0.19 (SDK 2.30, 2.31) is
published as wheels only, and its release notes name no change to either class. Every SDK import is lazy: installing and using
this package on a host without the SDK never needs it.
"""

from .backend import NeuronBackend
from .target import TARGETS, NeuronTarget, has_neuron_device, require_neuron_sdk

__all__ = ["TARGETS", "NeuronBackend", "NeuronTarget", "has_neuron_device", "require_neuron_sdk"]

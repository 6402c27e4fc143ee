"""vLLM platform plugin (entry point `neuron_chunked` in group `vllm.platform_plugins`).

It activates whenever it is installed and selected: vLLM loads every platform plugin unless
VLLM_PLUGINS lists the ones to load, so `VLLM_PLUGINS=` (empty) or a list without
`neuron_chunked` deselects it and vLLM falls back to its built-in platform (e.g. CPU). If
another out-of-tree platform plugin is active too, vLLM refuses to start and names both:
choose one with VLLM_PLUGINS. Once active, the platform serves export folders only and
refuses anything else at start-up with a message.
"""

PLATFORM = "optimum_neuron_chunked.vllm.platform.NeuronChunkedPlatform"


def register() -> str:
    return PLATFORM

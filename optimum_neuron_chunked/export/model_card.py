"""The model card (README.md) of an export: what was compiled, for which host, by which version,
so a user browsing the Hub can tell where an export runs."""

from __future__ import annotations

from pathlib import Path

from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.graphs import graph_specs
from optimum_neuron_chunked.hub import is_repo_id

HOSTS = {
    "neuron": "AWS {instance_type} instances (Neuron SDK 2.27-2.29)",
    "cpu": "a host CPU with {isa} (AOTInductor; x86-64 Linux, torch {torch})",
    "eager": "the host CPU (no compiled graphs; for tests)",
    "xla": "torch-xla's device (PJRT_DEVICE, CPU by default; the neuron backend's graphs without neuronx-cc)",
}


def model_card(model: str, config: NeuronConfig) -> str:
    """The export's README.md: Hub front matter, then the body around the table."""
    import torch

    host = HOSTS[config.backend].format(
        instance_type=config.instance_type, torch=torch.__version__, isa=config.cpu_isa
    )
    front = ["---", "library_name: optimum-neuron-chunked", "tags: [neuron, chunked-prefill]"]
    if is_repo_id(model):
        front.append(f"base_model: {model}")
    table = "\n".join(f"| {k} | {v} |" for k, v in _rows(model, config, host).items())
    return "\n".join(front) + _body(model, config, host, table)


def _rows(model: str, config: NeuronConfig, host: str) -> dict[str, object]:
    """The card's table: what was compiled, for which host."""
    prefill = (
        f"chunks of {config.prefill_chunk_size} tokens" if config.chunked else "whole prompts (standard)"
    )
    return {
        "source model": model,
        "runs on": host,
        "backend": config.backend + (f" ({config.instance_type})" if config.instance_type else ""),
        "graphs": ", ".join(s.name for s in graph_specs(config)),
        "concurrent sequences (batch size)": config.batch_size,
        "sequence length": config.sequence_length,
        "prefill": prefill,
        "context buckets": ", ".join(map(str, config.context_buckets)),
        "prefill widths": ", ".join(map(str, config.prefill_widths)) or "-",
        "decode widths (rows)": ", ".join(map(str, config.decode_widths)),
        "mixed steps (decodes + a chunk in one call)": "yes" if config.mixed_step else "no",
        "dtype": config.dtype,
        "quantization": _quantization(config),
        "KV cache": _kv_cache(config),
        "LoRA adapter slots": _lora(config),
        "tensor parallel degree": config.tp_degree,
        "on-device sampling": f"top-k <= {config.max_topk}" if config.on_device_sampling else "off",
        "optimum-neuron-chunked": config.package_version,
    }


def _body(model: str, config: NeuronConfig, host: str, table: str) -> str:
    return f"""
---

# {Path(model).name}, compiled for {config.backend}

An export of optimum-neuron-chunked {config.package_version}: compiled
graphs, their weights and the model's tokenizer. It runs on {host}, with the same package
version; it is not a checkpoint to fine-tune.

| | |
|---|---|
{table}

## Use

```bash
vllm serve <this repo id>      # with optimum-neuron-chunked installed: its vLLM platform
```

```python
from optimum_neuron_chunked import NeuronModelForCausalLM
model = NeuronModelForCausalLM.from_pretrained("<this repo id>")
```

Graph packages are native code that runs when loaded: load exports only from sources you trust.
"""


def write_model_card(out: Path, model: str, config: NeuronConfig) -> None:
    (out / "README.md").write_text(model_card(model, config))


def _kv_cache(config: NeuronConfig) -> str:
    if config.kv_cache_dtype != "fp8":
        return config.dtype
    scales = "the checkpoint's K / V scales, fitted into +-240" if config.kv_cache_scales else "scale 1"
    return f"fp8 e4m3, {scales}"


def _lora(config: NeuronConfig) -> str:
    if not config.has_lora_slots:
        return "none"
    return f"{config.max_loras} of rank <= {config.max_lora_rank} on {', '.join(config.lora_target_modules)}"


def _quantization(config: NeuronConfig) -> str:
    """The weights' storage: the projections' 8-bit format and its scales, or none."""
    if not config.quantization:
        return f"none (weights in {config.dtype})"
    scales = "block-wise scales" if config.quantization_block else "a scale per output channel"
    kept = (
        f", kept in {config.dtype}: {', '.join(config.quantization_skip)}" if config.quantization_skip else ""
    )
    return f"{config.quantization} projections, {scales}{kept}"

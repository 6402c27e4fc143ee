"""Helpers shared by the tests: prompts, export parameters, vLLM request shorthands, tiny
neuron configs. Reference generations, checkpoints and the `vllm serve` harness are in
optimum_neuron_chunked.testing (benchmarks use them too)."""

from __future__ import annotations

import pytest
import torch
from fixtures.export_models import EXPORTS

from optimum_neuron_chunked.config import NeuronConfig

NEW_TOKENS = 10

EXPORT_MARKS = {"cpu": [pytest.mark.slow], "xla": [pytest.mark.xla]}

# graph name -> HloReport of the graphs test_xla lowered, printed at the end of the session (conftest)
HLO_CENSUS: dict = {}


def export_params(ids: list[str]) -> list:
    """Indirect parameters for `neuron_model`: cpu exports are marked slow (they compile), xla
    exports xla (they need torch-xla)."""
    return [pytest.param(i, id=i, marks=EXPORT_MARKS.get(EXPORTS[i].backend, [])) for i in ids]


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    # ids 4.. skip the special tokens (eos would end generation early)
    return torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(1000 * seed + n))


def greedy(n: int = NEW_TOKENS, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs)


def refusal_at_start(model, **engine_args) -> str:
    """What vLLM's own config path (the one `vllm serve` and `LLM()` take before any engine
    starts, platform hooks included) raises for `model` and `engine_args`, whitespace folded.
    Cheaper than a refused `vllm serve` (tests/test_vllm_service.py keeps one, to show the
    message reaches the user)."""
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception) as refused:  # noqa: B017 - vLLM wraps some errors in its own types
        EngineArgs(model=str(model), **engine_args).create_engine_config()
    return " ".join(str(refused.value).split())


def greedy_rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On-device sampling inputs of n greedy decode rows: (sampling params [n, 3], rand [n])."""
    from optimum_neuron_chunked.modeling.sampler import sampling_params

    return torch.tensor([sampling_params(temperature=0.0)] * n), torch.zeros(n)


def generate(llm, prompts: list[torch.Tensor], params) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params)]


def engine_greedy_tokens(model, prompts: list[torch.Tensor], n: int) -> list[list[int]]:
    """Greedy tokens of `prompts` submitted together to a `vllm.LLM` of its own on `model` (chunks
    mixed with decodes), the engine shut down after."""
    from vllm import LLM

    llm = LLM(model=str(model), seed=0)
    try:
        return [list(o.token_ids) for o in generate(llm, prompts, greedy(n))]
    finally:
        llm.llm_engine.engine_core.shutdown()


class RecordingGraphs(dict):
    """The loaded graphs, recording which ran."""

    def __init__(self, graphs):
        super().__init__(graphs)
        self.ran = []

    def __getitem__(self, name):
        self.ran.append(name)
        return super().__getitem__(name)


def small_neuron_config(tp: int = 1, **fields) -> NeuronConfig:
    """A chunked neuron export of the tiny shapes the NxD checks trace (trn1, C=16, S=64)."""
    shapes = dict(
        batch_size=2,
        sequence_length=64,
        prefill_chunk_size=16,
        context_buckets=(32, 64),
        backend="neuron",
        instance_type="trn1",
        tp_degree=tp,
    )
    return NeuronConfig(**(shapes | fields))


def every_graph_kind(tp: int = 1) -> dict[str, NeuronConfig]:
    """Configs whose graph sets hold every kind of graph and every input count: CP (narrow
    and full), CE, TG (narrow and full, with and without sampling), MX (with and without
    sampling), VF (narrow and full), copy, prompt logits, paged KV, LoRA slots, an fp8 KV pool.
    tests/nxd_source_check.py traces them with NxD."""
    return {
        "chunked": small_neuron_config(
            tp, prefill_widths=(4, 16), decode_widths=(1, 2), mixed_step=True, prompt_logprobs=True
        ),
        "chunked-host-sampling": small_neuron_config(tp, mixed_step=True, on_device_sampling=False),
        "standard": small_neuron_config(tp, prefill_chunk_size=0, decode_widths=(1, 2), speculation_length=3),
        "paged": small_neuron_config(tp, mixed_step=True, kv_cache_blocks=12, kv_block_size=8),
        # adapter slots in every graph (their column in the block tables: no input more)
        "lora": small_neuron_config(tp, mixed_step=True, max_loras=2, max_lora_rank=8),
        "fp8-kv": small_neuron_config(tp, mixed_step=True, kv_cache_dtype="fp8"),
    }


def saved_by_transformers_5(checkpoint, out):
    """A copy of `checkpoint` whose tokenizer files are as transformers 5 writes them for a
    tokenizers-backed tokenizer (5.19: tokenizer.json, chat_template.jinja and a
    tokenizer_config.json naming `TokenizersBackend`, a class 4.x does not know), whichever
    transformers built the checkpoint."""
    import json
    import shutil

    out.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)
    source = json.loads((checkpoint / "tokenizer_config.json").read_text())
    template = checkpoint / "chat_template.jinja"
    (out / "chat_template.jinja").write_text(
        template.read_text() if template.is_file() else source["chat_template"]
    )
    specials = {k: source[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in source}
    config = {
        "backend": "tokenizers",
        **specials,
        "model_max_length": int(1e30),
        "tokenizer_class": "TokenizersBackend",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


QMAX = {"int8": 127.0, "fp8": 240.0}
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantization_rule(w: torch.Tensor, quantization: str) -> tuple[torch.Tensor, torch.Tensor]:
    """--quantization written down independently of the export's code: per output channel (the
    last dim reduced), scale = amax / 127 (int8) or amax / 240 (fp8, Neuron's range), stored =
    w / scale rounded to nearest (int8: an integer; fp8: an e4m3 value)."""
    w = w.float()
    qmax = QMAX[quantization]
    scale = w.abs().amax(-1, keepdim=True) / qmax
    values = (w / scale).clamp(-qmax, qmax)
    return (torch.round(values) if quantization == "int8" else values).to(STORAGE[quantization]), scale


def fake_quantize(hf, quantization: str, keep=lambda module: False) -> None:
    """transformers' weights replaced by the rule's dequantized values (stored * scale)."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            projection = name.endswith("_proj.weight") and ".layers." in name
            if stacked or (projection and not keep(name.removesuffix(".weight"))):
                stored, scale = quantization_rule(param.data, quantization)
                param.copy_(stored.float() * scale)


# LoRA tests: the export (2 adapter slots of rank 8) and three peft adapters of the tiny llama
LORA_EXPORT = dict(batch_size=2, sequence_length=128, prefill_chunk_size=32, context_buckets=(64, 128),
                   max_loras=2, max_lora_rank=8)  # fmt: skip


def lora_adapters() -> dict:
    """name -> a peft adapter folder of the tiny llama, each different in kind (written once)."""
    from fixtures.export_models import cache_root, checkpoint_path

    from optimum_neuron_chunked.testing.lora_adapters import write_adapter

    base = checkpoint_path("llama")
    root = cache_root() / "adapters" / base.name  # each environment's checkpoint has its own
    return {
        "a": write_adapter(base, root / "a", seed=1, rank=8),
        "b": write_adapter(
            base, root / "b", seed=2, rank=4, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
        "c": write_adapter(
            base,
            root / "c",
            seed=3,
            rank=8,
            scale=1.0,
            use_rslora=True,
            rank_pattern={"v_proj": 4},
            alpha_pattern={"o_proj": 32},
            layers_to_transform=[1],
        ),  # fmt: skip
    }

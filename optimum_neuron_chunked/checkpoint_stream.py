"""An export's weights streamed from the checkpoint's safetensors, one tensor at a time.

transformers' from_pretrained holds the whole model, and converting it into the decoder's
layout made a second copy: ~2.4x the checkpoint's bytes resident. Here each
weight of the export is read from the checkpoint files, converted by the same functions
the in-memory path uses (`split_fused_projections`, `moe_layer_from_hf`, `tp_checkpoint`,
`rank_shard`), cast, sliced per rank, written (safetensors_io.SafetensorsWriter) and
released. Only one tensor (one MoE layer's experts) is in memory at a time.

On-disk names are what the conversions read: the names transformers 4.x holds in memory.
transformers 5 fuses qwen3_moe/mixtral experts in memory (conversion_mapping.py, 5.x) but
save_pretrained writes them back per expert, and hub checkpoints hold them per expert;
`moe_layer_from_hf` reads either layout. gpt-oss MXFP4 experts (`*_blocks`, `*_scales`) are
dequantised per tensor by transformers' own `convert_moe_packed_tensors`
(integrations/mxfp4.py, 4.57 and 5.x), to bfloat16 as its Mxfp4 dequantize path does, then
cast to the export dtype, as loading that model into the decoder did.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import NeuronConfig
from .modeling.decoder import DecoderModel
from .modeling.hf_state import rotary_buffer, split_fused_projections
from .modeling.layers import Rotary
from .modeling.moe import moe_layer_from_hf
from .modeling.parallel import ShardLayout, rank_shard, tp_checkpoint
from .modeling.quantization import EXPERT_WEIGHTS, fit_neuron_fp8, quantize, scale_name
from .quantized_checkpoint import SourceQuantization, dequantized, source_scale
from .safetensors_io import CheckpointFiles, SafetensorsWriter

_FUSED = {
    "q_proj.weight": "qkv_proj.weight",
    "k_proj.weight": "qkv_proj.weight",
    "v_proj.weight": "qkv_proj.weight",
    "gate_proj.weight": "gate_up_proj.weight",
    "up_proj.weight": "gate_up_proj.weight",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.mlp\.")


class StreamUnsupportedError(ValueError):
    """The checkpoint holds a tensor under a name the streamed path does not know."""


@dataclass(frozen=True)
class WeightFile:
    """One safetensors file of an export: rank `rank`'s weights, names prefixed by `prefix`."""

    path: str
    rank: int
    prefix: str = ""


def checkpoint_folder(model: str) -> Path | None:
    """The local folder holding `model`'s safetensors (a hub id: the cached snapshot, fetched
    if missing); None where it has none (e.g. pytorch_model.bin). Only the files transformers
    would load (model.safetensors or the index's model-*-of-*.safetensors): some repos also
    hold the same weights in another layout (mistral's consolidated.safetensors)."""
    local = Path(model)
    if not local.exists():
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(model, allow_patterns=["model*.safetensors", "*.json"]))
    return local if CheckpointFiles.present(local) else None


class ConvertedCheckpoint:
    """The decoder's unsharded weights (its names, lm_head included) converted from the
    checkpoint's tensors on request, each cast to the decoder's dtype for it; quantized ones
    (the decoder's `quantized_weights`) with their scales, quantized here or kept from an FP8
    checkpoint (`source`)."""

    def __init__(
        self,
        files: CheckpointFiles,
        hf_config,
        decoder: DecoderModel,
        source: SourceQuantization | None = None,
        head: dict[str, torch.Tensor] | None = None,
    ):
        self.files, self.hf_config, self.spec = files, hf_config, decoder.spec
        self.head = head or {}  # an EAGLE3 head's `draft.*` weights (modeling/eagle3.head_state)
        self.dtypes = {name: t.dtype for name, t in decoder.state_dict(keep_vars=True).items()}
        self.quantization, self.source = decoder.quantization, source
        self.quantized = decoder.quantized_weights()  # weight or scale name -> weight name
        self._pending: dict[str, torch.Tensor] = {}  # the other half of a pair computed together
        # A checkpoint saved from the base model (LlamaModel) lacks the "model." prefix;
        # from_pretrained adds it (base_model_prefix), and so does this map.
        bare = "model.embed_tokens.weight" not in files and "embed_tokens.weight" in files
        self.disk = {(f"model.{k}" if bare and k != "lm_head.weight" else k): k for k in files.keys()}
        self._layer: tuple[int, dict[str, torch.Tensor]] | None = None
        self._expert_scales: dict[str, torch.Tensor] = {}  # an FP8 layer's, stacked as its experts
        self._skeleton: nn.Module | None = None
        self._fused: tuple[str, torch.Tensor] | None = None

    def tensor(self, name: str) -> torch.Tensor:
        if name in self._pending:
            return self._pending.pop(name)
        weight = self.quantized.get(name)
        if weight is None and self.source is not None and self.source.fp8 and name.endswith(".weight"):
            return self._fp8_dequantized(name).to(self.dtypes[name])
        if weight is None:
            return self._convert(name).to(self.dtypes[name])
        stored, scale = self._quantized(weight)
        other = scale_name(weight) if name == weight else weight
        self._pending[other] = scale if name == weight else stored
        return stored if name == weight else scale

    def _fp8_dequantized(self, name: str) -> torch.Tensor:
        """A weight of an FP8 checkpoint the export keeps in --dtype (--quantization-skip):
        its stored values times its scale; other tensors as they are."""
        stored = self._convert(name)
        if stored.dtype != torch.float8_e4m3fn:
            return stored
        disk_scale = name.removesuffix("weight") + self.source.scale_suffix
        return dequantized(stored, self._read(disk_scale), self.source)

    def _quantized(self, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A weight as stored, and its scale: the FP8 checkpoint's own (fitted into Neuron's
        range), or quantized here from full precision."""
        if self.source is None or not self.source.fp8:
            return quantize(self._convert(weight), self.quantization.dtype)
        stored = self._convert(weight)
        scale = self._expert_scales.pop(weight, None)
        if scale is None:
            disk_scale = weight.removesuffix("weight") + self.source.scale_suffix
            scale = source_scale(stored, self._read(disk_scale), self.source)
        if stored.dtype != torch.float8_e4m3fn:
            raise StreamUnsupportedError(f"{weight} is not FP8 in the checkpoint ({stored.dtype})")
        return fit_neuron_fp8(stored, scale)

    def _convert(self, name: str) -> torch.Tensor:
        if name in self.head:
            return self.head[name]
        if name.startswith("model.rotary_emb"):
            return self._rotary(name)
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"  # tied: lm_head is the embedding
        layer = _LAYER.match(name)
        if layer and not self.spec.dense_mlp(int(layer[1])):
            return self._moe_layer(int(layer[1])).pop(name)
        if name in self.disk:
            return self._read(name)
        suffix = next((s for s in _FUSED if name.endswith(s)), None)
        if self.spec.fused_projections and suffix:
            fused = name.removesuffix(suffix) + _FUSED[suffix]
            if self._fused is None or self._fused[0] != fused:
                self._fused = (fused, self._read(fused))  # q, k, v: one read of qkv_proj
            return split_fused_projections({fused: self._fused[1]}, self.spec)[name]
        raise StreamUnsupportedError(f"the checkpoint has no tensor {name!r} (nor one it converts from)")

    def _read(self, name: str) -> torch.Tensor:
        if name not in self.disk:
            raise StreamUnsupportedError(f"the checkpoint has no tensor {name!r}")
        return self.files.read(self.disk[name])

    def _moe_layer(self, i: int) -> dict[str, torch.Tensor]:
        """Sparse layer i converted as a whole (experts are stacked from per-expert tensors),
        kept until its tensors are taken; one layer at a time."""
        if self._layer is None or self._layer[0] != i:
            self._layer = None
            prefixes = (f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe.")
            state = {k: self._read(k) for k in self.disk if k.startswith(prefixes)}
            _dequantize_mxfp4(state)
            if self.source is not None and self.source.fp8:
                self._expert_scales = self._stacked_scales(state, i)
            self._layer = (i, moe_layer_from_hf(state, i, self.spec.model_type, self.spec.moe))
        return self._layer[1]

    def _stacked_scales(self, state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        """An FP8 layer's per-expert scales (popped from `state`), stacked by the conversion that
        stacks its weights: each scale stands in for its weight -> {stacked weight name: scales}."""
        suffix = self.source.scale_suffix
        scales = {k: v for k, v in state.items() if v.dtype != torch.float8_e4m3fn and not k.endswith(suffix)}
        for name in [k for k in state if k.endswith("." + suffix)]:
            weight = name.removesuffix(suffix) + "weight"
            scales[weight] = source_scale(state[weight], state.pop(name), self.source)
        converted = moe_layer_from_hf(scales, i, self.spec.model_type, self.spec.moe)
        return {n: t for n, t in converted.items() if n.endswith(EXPERT_WEIGHTS)}

    def _rotary(self, name: str) -> torch.Tensor:
        if self._skeleton is None:
            self._skeleton = hf_skeleton(self.hf_config, self.dtypes["model.embed_tokens.weight"])
        module, which = name.split(".")[1:]
        buffer = rotary_buffer(self._skeleton, module, which)
        # no HF rotary for a layer type no layer has (gemma3, 5.x): the decoder's default
        return buffer if buffer is not None else getattr(Rotary(self.spec.head_dim), which).clone()


def _dequantize_mxfp4(state: dict[str, torch.Tensor]) -> None:
    for blocks in [k for k in state if k.endswith("_blocks")]:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        base = blocks.removesuffix("_blocks")
        state[base] = convert_moe_packed_tensors(state.pop(blocks), state.pop(f"{base}_scales"))


def hf_skeleton(hf_config, dtype: torch.dtype) -> nn.Module:
    """The transformers model of `hf_config` with its parameters on the meta device and its
    buffers real: the rotary inv_freq / attention_scaling as from_pretrained computes them
    (every rope_type, gemma3's local rotary), without the weights."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


@contextmanager
def parameters_on_meta():
    """Every parameter registered while open goes to the meta device (accelerate's
    init_empty_weights(include_buffers=False), which transformers 5 no longer ships)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            meta = module._parameters[name].to("meta")
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def stream_weights(
    folder: Path,
    hf_config,
    config: NeuronConfig,
    decoder: DecoderModel,
    files: list[WeightFile],
    tied: bool,
    out_dir: Path,
    quantized: SourceQuantization | None = None,
    head: dict[str, torch.Tensor] | None = None,
) -> int:
    """Write `files` (relative to `out_dir`) from the checkpoint in `folder`; `decoder` (meta
    is enough) gives the names, shapes and dtypes; `head`: an EAGLE3 head's weights. Returns
    the checkpoint's bytes."""
    checkpoint = CheckpointFiles(folder)
    source = ConvertedCheckpoint(checkpoint, hf_config, decoder, quantized, head)
    layout = ShardLayout.of(decoder.spec, config.tp_degree)
    names = list(decoder.unsharded_weights()) if tied else decoder.weight_names()  # + a tied lm_head
    shapes = _rank_shapes(decoder, names, layout)
    writers = []
    try:
        for f in files:
            (out_dir / f.path).parent.mkdir(parents=True, exist_ok=True)
            writers.append(
                SafetensorsWriter(out_dir / f.path, {f.prefix + n: shapes[f.rank][n] for n in names})
            )
        for name in names:  # a quantized weight, then its scale (ConvertedCheckpoint.tensor)
            full = tp_checkpoint({name: source.tensor(name)}, layout)[name]
            for f, writer in zip(files, writers, strict=True):
                writer.write(f.prefix + name, rank_shard({name: full}, config.tp_degree, f.rank)[name])
            del full
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.close()
    return checkpoint.nbytes()


def empty_but_inlined(decoder: DecoderModel, weights: Path) -> DecoderModel:
    """`decoder` (meta) on the cpu with uninitialised tensors (never written, so not resident),
    except its 0-d and 1-d tensors, read from `weights`: AOTInductor compiles those into the
    graph as literals instead of binding them at load (GraphLowering.get_attr,
    torch/_inductor/graph.py, torch 2.13: shape () -> value.item(), 1-d of <= 8 elements
    inlined). Norms, biases and rotary buffers are all 0-d/1-d and small; matrices are not."""
    decoder = decoder.to_empty(device="cpu")
    files = CheckpointFiles.of_file(weights)
    small = {name: files.read(name) for name, (_, info) in files.tensors.items() if len(info.shape) <= 1}
    _, unexpected = decoder.load_state_dict(small, strict=False)
    if unexpected:
        raise ValueError(f"{weights} holds tensors the decoder does not: {unexpected}")
    return decoder


def _rank_shapes(decoder: DecoderModel, names: list[str], layout: ShardLayout) -> list[dict]:
    """Per rank, (dtype, shape) of every name: the sharding functions run on meta tensors."""
    state = decoder.state_dict()
    meta = {n: state[n].to("meta") for n in names}
    if "lm_head.weight" not in meta:  # tied and stored once: pad it as the sharded lm_head
        meta["lm_head.weight"] = state["model.embed_tokens.weight"].to("meta")
    full = tp_checkpoint(meta, layout)
    shards = [rank_shard(full, layout.tp_degree, r) for r in range(layout.tp_degree)]
    return [{n: (shard[n].dtype, tuple(shard[n].shape)) for n in names} for shard in shards]


__all__ = [
    "ConvertedCheckpoint",
    "StreamUnsupportedError",
    "WeightFile",
    "checkpoint_folder",
    "empty_but_inlined",
    "hf_skeleton",
    "stream_weights",
]

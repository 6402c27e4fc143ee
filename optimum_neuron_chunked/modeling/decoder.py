"""A llama-family decoder with a static KV cache shared by every graph."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from ..lora_targets import is_slot
from . import eagle3 as eagle3_head
from .attention import Attention
from .eagle3 import Eagle3Spec
from .family import FamilySpec
from .hf_state import rotary_buffer, split_fused_projections
from .kernels import GraphPart, Kernels
from .kv_cache import KVCache
from .kv_layout import KVLayout
from .layers import MLP, Rotary, rms_norm
from .lora import LoraSpec, split_tables, token_mask
from .moe import SparseMoE, moe_state_from_hf
from .parallel import ShardLayout, TorchLayers, rank_shard, tp_checkpoint
from .quantization import EXPERT_WEIGHTS, QuantSpec, quantize, quantize_modules, scale_name


class PartInputs(NamedTuple):
    """One part of a graph call (DecoderModel.parts_hidden_states): a prefill chunk or decode rows."""

    input_ids: torch.Tensor  # [N, T]
    position_ids: torch.Tensor  # [N, T]
    # [N, ceil(window / P)] block tables (kv_cache.py); LoRA exports: + the rows' adapter slots
    # as one more column (lora.with_adapter_column)
    tables_and_slot: torch.Tensor
    decode_rows: bool  # TG, VF, MX's decode part: the graph kind's choice


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: FamilySpec,
        layer_idx: int,
        layout: ShardLayout,
        layers,
        kernels: Kernels,
        lora_spec: LoraSpec | None = None,
    ):
        super().__init__()
        sliding_window = spec.sliding_windows[layer_idx]
        self.self_attn = Attention(
            spec,
            sliding_window=sliding_window,
            layout=layout,
            layers=layers,
            kernels=kernels,
            use_rope=spec.uses_rope(layer_idx),
            local_rope=spec.local_rope and sliding_window is not None,
            lora_spec=lora_spec,
        )
        self.sparse = not spec.dense_mlp(layer_idx)
        if self.sparse:  # experts take no adapters (lora_targets.MLP_TARGETS)
            self.mlp = SparseMoE(spec.hidden_size, spec.moe, layers, kernels.expert_selection)
        else:
            self.mlp = MLP(
                spec.hidden_size, spec.intermediate_size, spec.mlp_bias, layers, spec.hidden_act, lora_spec
            )
        norm = functools.partial(rms_norm, spec.hidden_size, spec.rms_norm_eps, spec.gemma_norms)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        # Gemma3DecoderLayer: post_attention_layernorm normalises the attention output, and the
        # MLP has its own norms before and after (the names are transformers').
        self.sandwich_norms = spec.gemma_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.residual_multiplier = spec.residual_multiplier

    def forward(
        self, x: torch.Tensor, parts: tuple[GraphPart, ...], cache: KVCache, lora_mask=None
    ) -> tuple[torch.Tensor, KVCache]:
        """x [1, R, H]: every part's tokens (Attention.forward); `lora_mask` [R, S*r] (lora.py)."""
        h, cache = self.self_attn(self.input_layernorm(x), parts, cache, lora_mask)
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(
                self._mlp(self.pre_feedforward_layernorm(x), lora_mask)
            ), cache
        x = x + h * self.residual_multiplier
        return x + self._mlp(self.post_attention_layernorm(x), lora_mask) * self.residual_multiplier, cache

    def _mlp(self, x: torch.Tensor, lora_mask) -> torch.Tensor:
        return self.mlp(x) if self.sparse else self.mlp(x, lora_mask)


class DecoderBody(nn.Module):
    def __init__(
        self,
        spec: FamilySpec,
        layout: ShardLayout,
        layers,
        kernels: Kernels,
        lora_spec: LoraSpec | None = None,
    ):
        super().__init__()
        self.embed_tokens = layers.embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, layout, layers, kernels, lora_spec) for i in range(spec.num_layers)
        )
        self.norm = rms_norm(spec.hidden_size, spec.rms_norm_eps, spec.gemma_norms)
        self.rotary_emb = Rotary(spec.head_dim)
        if spec.local_rope:  # gemma3: the sliding layers' rotary (its own base)
            self.rotary_emb_local = Rotary(spec.head_dim)

    def rotaries(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(cos, sin) of the global rotary, and of the local one where the family has it."""
        global_ = self.rotary_emb.cos_sin(position_ids, dtype)
        local = (
            self.rotary_emb_local.cos_sin(position_ids, dtype) if hasattr(self, "rotary_emb_local") else None
        )
        return global_, local


class DecoderModel(nn.Module):
    """Weights (named as in the HF checkpoint) plus the KV cache buffers.

    KV cache: per layer a pool of k/v blocks [num_blocks, kv_heads, block, head_dim], as `kv`
    (kv_layout.KVLayout) lays it out; graphs address it by block tables [N, ceil(W / P)]
    (kv_cache.py). Under tensor parallelism this is one rank's model: its weight shards and
    the KV heads it holds.

    `functional_cache`: graphs write the cache into new tensors and reassign the buffers
    (XLA tracing) instead of updating them in place (torch backends).

    `kernels`: how linear layers, attention and experts compute (modeling/kernels.py: the
    reference unless a backend supplies its own, Backend.kernels).

    `quantization`: the projections stored quantized (quantization.py), built by the layer
    factory's `quantized`.

    `eagle3`: an EAGLE3 head (modeling/eagle3.py) as submodule `draft`, built after quantization
    (never quantized), with its KV pool and the aux states every graph call leaves behind
    (`aux_rows` of them: eagle3.aux_rows).
    """

    def __init__(
        self,
        spec: FamilySpec,
        kv: KVLayout,
        layers=None,
        functional_cache: bool = False,
        kernels: Kernels | None = None,
        quantization: QuantSpec | None = None,
        lora_spec: LoraSpec | None = None,
        eagle3: Eagle3Spec | None = None,
        aux_rows: int = 0,
    ):
        super().__init__()
        self.kernels = kernels or Kernels()
        self.lora_spec = lora_spec
        layers = layers or TorchLayers(self.kernels.linear)
        self.spec = spec
        self.layout = ShardLayout.of(spec, layers.tp_degree)
        self.functional_cache = functional_cache
        self.kv = kv
        self.model = DecoderBody(spec, self.layout, layers, self.kernels, lora_spec)
        self.lm_head = layers.column(
            spec.hidden_size, self.layout.padded_vocab, bias=False, gather_output=True
        )
        # Parallel layers split the embedding by hidden dim and lm_head by vocabulary: not tied.
        self.tied = spec.tie_word_embeddings and isinstance(layers, TorchLayers)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.to(kv.dtype)
        for i in range(kv.num_layers):  # after the cast: an fp8 pool stays fp8
            cache_shape = (
                kv.num_blocks,
                self.layout.kv_heads_per_rank,
                kv.layer(i).block_size,
                spec.head_dim,
            )
            for name in (f"k_cache_{i}", f"v_cache_{i}"):
                self.register_buffer(name, torch.zeros(cache_shape, dtype=kv.pool_dtype), persistent=False)
        for rotary in self.model.modules():
            if isinstance(rotary, Rotary):
                rotary.float()  # rotary angles stay fp32, as in transformers
        # after the cast to the model dtype, which would cast fp8 weights too
        self.quantization = quantization
        self.quantized_modules = quantize_modules(self, quantization, layers) if quantization else []
        self.eagle3 = eagle3
        if eagle3 is not None:
            eagle3_head.attach_head(self, eagle3, layers, aux_rows)

    def weight_names(self) -> list[str]:
        """Names of the stored weights: every tensor once, under the first name it has (adapter
        slots are not stored: zero until an adapter is written, lora.py)."""
        skip = self._alias_names() | set(self.lora_slots())
        return [name for name in self.state_dict(keep_vars=True) if name not in skip]

    def _alias_names(self) -> set[str]:
        """Further names of a tensor that already has one: a tied lm_head (the embedding's
        weight), and the `master_weight` of neuronx-distributed's Column/RowParallelLinear
        built inside NxDParallelState: in AOT mode `_initialize_parameter_cpu` returns the
        weight itself and `init_weight_cpu` stores it as `self.master_weight`, so state_dict()
        lists both names (parallel_layers/layers.py, Release 2.29 / 0.18.0). NxD loads
        checkpoints by named_parameters(), which lists `weight` only."""
        seen, aliases = set(), set()
        for name, tensor in self.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                aliases.add(name)
            seen.add(id(tensor))
        return aliases

    def quantized_weights(self) -> dict[str, str]:
        """Each stored quantized weight and its scale -> the weight's name."""
        named = {}
        for module in self.quantized_modules:
            experts = module.endswith(".experts")
            for weight in [f"{module}.{w}" for w in EXPERT_WEIGHTS] if experts else [f"{module}.weight"]:
                named[weight] = named[scale_name(weight)] = weight
        return named

    def _tied_names(self) -> set[str]:
        return {"lm_head.weight"} if self.tied else set()

    def stored_weights(self) -> dict[str, torch.Tensor]:
        state = self.state_dict()
        return {name: state[name].contiguous() for name in self.weight_names()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = set(missing) - self._alias_names() - set(self.lora_slots())
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the model: missing {sorted(missing)}, unexpected {unexpected}"
            )

    def constants(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer by name, tied names included: what a compiled graph binds."""
        named = dict(self.named_parameters(remove_duplicate=False))
        named.update(self.named_buffers(remove_duplicate=False))
        return {k: v.detach() for k, v in named.items()}

    def cache_names(self) -> list[str]:
        layers = [f"{kv}_cache_{i}" for i in range(self.spec.num_layers) for kv in ("k", "v")]
        return layers + eagle3_head.draft_cache_names(self)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        tables_and_slot: torch.Tensor,
        window: int,
        decode_rows: bool = False,
    ) -> torch.Tensor:
        """[N, T] tokens at [N, T] positions of rows with block tables [N, ceil(window / P)]
        (and the adapter column: PartInputs) -> final-norm hidden states [N, T, H]."""
        (hidden,) = self.parts_hidden_states(
            (PartInputs(input_ids, position_ids, tables_and_slot, decode_rows),), window
        )
        return hidden

    def parts_hidden_states(self, parts: tuple[PartInputs, ...], window: int) -> tuple[torch.Tensor, ...]:
        """One graph call over parts, every part attending over context bucket `window` -> each
        part's final-norm hidden states [N, T, H]. Embeddings, projections and MLP run once over
        all the parts' tokens (kernels.GraphPart).

        Integer inputs may arrive as int32 (graphs.INDEX_DTYPE): they are widened here, once,
        because index_put/index_copy want int64 indices and XLA refuses to mix S32 with the
        S64 of torch.arange (the head index of the functional cache write).
        """
        # the adapter column off the block tables (lora.py); each part's slots None without slots
        tables, row_slots = zip(
            *[split_tables(p.tables_and_slot, self.lora_spec) for p in parts], strict=True
        )
        ids = [p.input_ids.long() for p in parts]
        x = self.model.embed_tokens(torch.cat([i.reshape(-1) for i in ids])[None])  # [1, R, H]
        # The multiplier rounded to the model dtype first, as Gemma3TextScaledWordEmbedding does.
        x = x * torch.tensor(self.spec.embedding_multiplier, dtype=x.dtype).item()
        lora_mask = None
        if self.lora_spec is not None:
            slots = [s.long() for s in row_slots]
            lora_mask = token_mask(slots, [i.shape[1] for i in ids], self.lora_spec, x.dtype)
        graph_parts = tuple(
            self._graph_part(p, t.long(), window, x.dtype) for p, t in zip(parts, tables, strict=True)
        )
        aux_ids, aux = self.eagle3.aux_layer_ids if self.eagle3 is not None else (), []
        for i, layer in enumerate(self.model.layers):
            if i in aux_ids:  # EAGLE3's id k: the residual stream entering layer k
                aux.append(x)
            x, cache = layer(x, graph_parts, self.layer_cache(i), lora_mask)
            if self.functional_cache:
                setattr(self, f"k_cache_{i}", cache.keys)
                setattr(self, f"v_cache_{i}", cache.values)
        if len(self.model.layers) in aux_ids:  # id L: after the last layer, before the norm
            aux.append(x)
        if aux:
            eagle3_head.keep_aux_states(self, torch.cat(aux, -1)[0])
        hidden = self.model.norm(x)[0]
        sizes = [p.tokens for p in graph_parts]
        return tuple(
            h.view(*p.position_ids.shape, -1) for h, p in zip(hidden.split(sizes), graph_parts, strict=True)
        )

    def _graph_part(self, part: PartInputs, tables: torch.Tensor, window: int, dtype) -> GraphPart:
        """One part as the layers see it: positions int64, its block tables, its cache read."""
        positions = part.position_ids.long()
        read = self.kernels.cache_read(self.kv, positions, tables, window, part.decode_rows)
        return GraphPart(positions, tables, read, part.decode_rows, self.model.rotaries(positions, dtype))

    def lora_slots(self) -> dict[str, torch.Tensor]:
        """Every adapter slot tensor by name (lora_targets.slot_name)."""
        return {name: p for name, p in self.named_parameters() if is_slot(name)}

    def layer_cache(self, i: int) -> KVCache:
        """Layer i's cache buffers with their addressing (the buffers keep their export names)."""
        k, v = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
        return KVCache(k, v, self.kv.layer(i), self.functional_cache, self.kv.storage(i))

    def copy_positions(self, position_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Copy the K/V of `position_ids` [1, T] from block blocks[0] to block blocks[1], every
        layer (KVCache.copy: the COPY prefix cache; pools of smaller blocks share blocks instead
        and have no copy graph)."""
        position_ids, blocks = position_ids.long(), blocks.long()
        for i in range(self.kv.num_layers):
            cache = self.layer_cache(i).copy(position_ids, blocks[:1], blocks[1:])
            if self.functional_cache:
                setattr(self, f"k_cache_{i}", cache.keys)
                setattr(self, f"v_cache_{i}", cache.values)
        if self.eagle3 is not None:  # the head's K/V of a cached prefix too
            eagle3_head.keep_draft_cache(
                self, eagle3_head.draft_cache(self).copy(position_ids, blocks[:1], blocks[1:])
            )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)[..., : self.spec.vocab_size]  # drop the vocabulary padding
        logits = logits.float() / self.spec.logits_divisor
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def unsharded_weights(self) -> dict[str, torch.Tensor]:
        """The checkpoint held by a tp-1 model, lm_head included even when tied."""
        state = self.state_dict()
        return {name: state[name] for name in [*self.weight_names(), *self._tied_names()]}

    def full_weights_from_hf(self, hf_model: nn.Module, head: dict | None = None) -> dict[str, torch.Tensor]:
        """The unsharded checkpoint in this module's names, lm_head included even when tied;
        `head`: an EAGLE3 head's weights (eagle3.head_state)."""
        hf_state = hf_model.state_dict()
        if self.spec.fused_projections:
            hf_state = split_fused_projections(hf_state, self.spec)
        if self.spec.moe is not None:
            hf_state = moe_state_from_hf(hf_state, self.spec.model_type, self.spec.moe)
        state, quantized = {}, self.quantized_weights()
        for weight in set(quantized.values()):
            state[weight], state[scale_name(weight)] = quantize(hf_state[weight], self.quantization.dtype)
        for name in self.weight_names() + ["lm_head.weight"]:
            if name in quantized:
                continue
            if name.startswith(f"{eagle3_head.DRAFT}."):
                state[name] = head[name]
            elif name.startswith("model.rotary_emb"):
                buffer = rotary_buffer(hf_model, *name.split(".")[1:])
                state[name] = buffer if buffer is not None else self.state_dict()[name].clone()
            elif name == "lm_head.weight" and self.spec.tie_word_embeddings:
                state[name] = hf_state["model.embed_tokens.weight"]
            else:
                state[name] = hf_state[name]
        return state

    def weights_from_hf(self, hf_model: nn.Module, rank: int = 0, head: dict | None = None) -> dict:
        """State dict for this module (rank `rank`'s shard) from a transformers model of its family."""
        return self.rank_weights(self.full_weights_from_hf(hf_model, head), rank)

    def rank_weights(self, full: dict[str, torch.Tensor], rank: int = 0) -> dict[str, torch.Tensor]:
        """This rank's shard of an unsharded checkpoint (the checkpoint itself at tp 1)."""
        shard = rank_shard(tp_checkpoint(full, self.layout), self.layout.tp_degree, rank)
        return {name: shard[name] for name in self.weight_names()}

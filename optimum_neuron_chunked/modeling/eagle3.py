"""EAGLE3 speculative decoding: THE rule, in one module - the head's shapes (from its
config.json), its weights' names, its math and the drafts it proposes on the device.

The head (vLLM's model_executor/models/llama_eagle3.py, v0.32.0; speculators 0.9.0's
Eagle3DraftModel): the target's residual stream entering layers `aux_layer_ids` (id L: after
the last layer, before the final norm), concatenated in ascending order, through `fc`; one
decoder layer attending over [input_layernorm(embed(token)), hidden_norm(h)]; the residual h
(hidden_norm(h) with `norm_before_residual`); a final norm, then lm_head over
`draft_vocab_size`, mapped to target ids by `d2t` (target = draft + d2t[draft]). The next
step carries the pre-norm hidden (post-norm with `norm_output`).

Drafting (vLLM's padded drafter batch, v1/spec_decode/llm_base_proposer.py, v0.32.0): a first
pass over a call's tokens shifted left by one, the next token at each row's last accepted
index, at the target's positions; then K - 1 steps at the next positions, fed the previous
draft and the carried hidden. The head's K/V is one full-attention layer of the target's pool
(kv_layout.KVLayout.draft): rejected positions keep stale K/V until a later pass rewrites them,
before any query reads them (keys are masked by position), as the target's do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ceil_div
from .attention import Attention
from .family import FamilySpec, UnsupportedArchitectureError
from .kernels import GraphPart
from .kv_cache import KVCache
from .layers import MLP, Rotary, rms_norm
from .lora import split_tables
from .parallel import ShardLayout

DRAFT = "draft"  # the head's submodule of DecoderModel: its weights are `draft.*`
SHAREABLE = ("embed_tokens", "lm_head")  # taken from the target where the head lacks them
# speculators' layout names the one layer `layers.0.`, yuhuili's `midlayer.` (vLLM's mapper)
LAYER_PREFIXES = ("midlayer.", "layers.0.")


class Eagle3FitError(UnsupportedArchitectureError):
    """A head whose shapes do not fit the target, or that this package cannot run (the export's
    CLI and vLLM's platform say it as they say an unsupported target)."""


@dataclass(frozen=True)
class Eagle3Spec:
    """The head's shapes and options, from its config.json and the target's FamilySpec."""

    model_type: str  # of its layer: llama, or qwen3 (q_norm / k_norm)
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states (vLLM 0.32)
    fc_norm: bool = False  # an RMSNorm per aux state (vLLM 0.32)
    norm_output: bool = False  # the next step carries the post-norm hidden (vLLM 0.32)
    logit_scale: float = 1.0
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    num_layers: int = 1
    rope: str = "{}"  # the layer config's rotary fields, JSON (Eagle3Spec.rotary)
    shares: tuple[str, ...] = ()  # SHAREABLE weights the head takes from the target

    @classmethod
    def of(cls, head_config: dict, target: FamilySpec, shares: tuple[str, ...] = ()) -> Eagle3Spec:
        """yuhuili's `LlamaForCausalLMEagle3` config (flat), or speculators' `Eagle3Speculator`
        (`transformer_layer_config` + top-level eagle fields), as vLLM reads them
        (transformers_utils/configs/speculators/algos.py, v0.32.0: norm_before_residual True
        when a speculators config leaves it out; False for yuhuili's)."""
        layer = dict(head_config.get("transformer_layer_config") or head_config)
        speculators = "speculators_config" in head_config
        top = head_config.get
        hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
        eagle = layer.get("eagle_config") or top("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is False:
            raise Eagle3FitError(
                "a head without aux hidden states (use_aux_hidden_state false) is not EAGLE3: pass an "
                "EAGLE3 head (trained on the target's aux hidden states), or drop --speculation-head "
                "and draft by prompt lookup with --speculation-length K alone"
            )
        return cls(
            model_type=layer.get("model_type", "llama"),
            hidden_size=hidden,
            target_hidden_size=top("target_hidden_size") or layer.get("target_hidden_size") or hidden,
            num_heads=heads,
            num_kv_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or hidden // heads,
            intermediate_size=layer["intermediate_size"],
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            vocab_size=layer["vocab_size"],
            draft_vocab_size=top("draft_vocab_size") or layer["vocab_size"],
            aux_layer_ids=aux_layer_ids(head_config, eagle, target.num_layers),
            norm_before_residual=bool(top("norm_before_residual", speculators)),
            norm_before_fc=bool(top("norm_before_fc") or eagle.get("norm_before_fc")),
            fc_norm=bool(top("fc_norm")),
            norm_output=bool(top("norm_output")),
            logit_scale=float(layer.get("logit_scale", 1.0)),
            attention_bias=bool(layer.get("attention_bias", False)),
            mlp_bias=bool(layer.get("mlp_bias", False)),
            hidden_act=layer.get("hidden_act", "silu"),
            num_layers=layer.get("num_hidden_layers", 1),
            rope=json.dumps({k: v for k, v in layer.items() if k in ROPE_FIELDS}, sort_keys=True),
            shares=tuple(s for s in SHAREABLE if s in shares),
        )

    def fit_error(self, target: FamilySpec) -> str | None:
        """Why this head cannot draft for `target` (an export refuses it by name), or None."""
        for field, head, wanted in (
            ("target_hidden_size", self.target_hidden_size, target.hidden_size),
            ("vocab_size", self.vocab_size, target.vocab_size),
            ("num_key_value_heads", self.num_kv_heads, target.num_kv_heads),
            ("head_dim", self.head_dim, target.head_dim),
        ):
            if head != wanted:
                return f"the head's {field} is {head}, the target's {wanted}"
        if not self.aux_layer_ids or not all(0 <= k <= target.num_layers for k in self.aux_layer_ids):
            return f"aux layer ids {list(self.aux_layer_ids)} are not layers 0..{target.num_layers} of the target"
        if self.shares and self.hidden_size != target.hidden_size:
            return (
                f"the head's hidden_size {self.hidden_size} cannot use the target's {', '.join(self.shares)}"
            )
        if self.num_layers != 1 or self.hidden_act != "silu" or self.model_type not in ("llama", "qwen3"):
            return "only one-layer silu heads of llama or qwen3 layers run here"
        if self.draft_vocab_size > self.vocab_size or (
            "lm_head" in self.shares and self.draft_vocab_size != self.vocab_size
        ):
            return f"draft_vocab_size {self.draft_vocab_size} does not fit the vocabulary {self.vocab_size}"
        return None

    def family(self) -> FamilySpec:
        """The head's layer as a family layer (attention.py, layers.py and the sharding rule)."""
        return FamilySpec(
            model_type=self.model_type,
            vocab_size=self.draft_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=False,
            hidden_act=self.hidden_act,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            qk_norm=self.model_type == "qwen3",
        )

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    def rotary(self) -> dict[str, torch.Tensor]:
        """The head's own rotary (its rope_theta / rope_scaling), as transformers computes it."""
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = LlamaConfig(**json.loads(self.rope), head_dim=self.head_dim)
        rotary = LlamaRotaryEmbedding(config)
        return {
            "inv_freq": rotary.inv_freq.float(),
            "attention_scaling": torch.tensor(float(rotary.attention_scaling)),
        }


ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "hidden_size",
               "num_attention_heads", "partial_rotary_factor")  # fmt: skip


def aux_layer_ids(head_config: dict, eagle: dict, num_layers: int) -> tuple[int, ...]:
    """Top-level `eagle_aux_hidden_state_layer_ids`, else eagle_config's, else (2, L // 2, L - 3);
    sorted and de-duplicated (vLLM 0.32: gpu_model_runner._get_eagle3_aux_layers_from_config,
    EagleModelMixin._set_aux_hidden_state_layers)."""
    ids = head_config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    return tuple(sorted(set(ids or (2, num_layers // 2, num_layers - 3))))


def aux_rows(config) -> int:
    """The most tokens one graph call of export `config` runs: a chunk, or B verify rows of K + 1."""
    return max(config.prefill_chunk_size, config.batch_size * (config.speculation_length + 1))


def chain_top(position, steps: int, sequence_length: int):
    """THE chain extent: the last position a chain of `steps` drafts from the token at `position`
    writes the head's K/V at - steps - 1 past it, clamped to S - 1 (`propose` writes what is past
    the sequence there; those drafts are dropped). `position`: an int, or a tensor of rows."""
    top = position + steps - 1
    if isinstance(top, torch.Tensor):
        return torch.clamp(top, max=sequence_length - 1)
    return min(top, sequence_length - 1)


def head_weight_name(checkpoint_name: str) -> str | None:
    """A head checkpoint's tensor name -> the decoder's (`draft.*`); None for what vLLM ignores
    (t2d; llama_eagle3.py load_weights, v0.32.0)."""
    if "t2d" in checkpoint_name:
        return None
    name = checkpoint_name.removeprefix("model.")
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            name = "layers.0." + name.removeprefix(prefix)
    return f"{DRAFT}.{name}"


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over 2H inputs, then the MLP, on the target's layers
    (attention.py, layers.py) so it shards by the same suffix rules (parallel.py)."""

    def __init__(self, spec: Eagle3Spec, layout: ShardLayout, layers, kernels):
        super().__init__()
        family, hidden = spec.family(), spec.hidden_size
        self.input_layernorm = rms_norm(hidden, spec.rms_norm_eps, False)
        self.hidden_norm = rms_norm(hidden, spec.rms_norm_eps, False)
        self.self_attn = Attention(
            family, sliding_window=None, layout=layout, layers=layers, kernels=kernels, input_size=2 * hidden
        )
        self.post_attention_layernorm = rms_norm(hidden, spec.rms_norm_eps, False)
        self.mlp = MLP(hidden, spec.intermediate_size, spec.mlp_bias, layers, spec.hidden_act)
        self.norm_before_residual = spec.norm_before_residual

    def forward(self, embeds, hidden, parts: tuple[GraphPart, ...], cache: KVCache) -> tuple:
        """embeds, hidden [1, R, H] -> (the layer's output [1, R, H], the cache written)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h, cache = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], -1), parts, cache)
        x = residual + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Eagle3Head(nn.Module):
    """The head's weights (`draft.*`) and math. Never quantized (DecoderModel builds it after
    quantization.quantize_modules). Its embed_tokens / lm_head exist only where it has its own
    (`Eagle3Spec.shares`: else the target's)."""

    def __init__(self, spec: Eagle3Spec, target_layout: ShardLayout, layers, kernels):
        super().__init__()
        self.spec = spec
        layout = ShardLayout.of(spec.family(), layers.tp_degree)
        if layout.kv_heads != target_layout.kv_heads:  # its pool is shaped as the target's layers'
            kv = spec.num_kv_heads  # a tp neither dividing nor divided by it replicates per query head
            raise Eagle3FitError(
                f"the head holds {layout.kv_heads} KV heads at tp {layout.tp_degree}, the target "
                f"{target_layout.kv_heads}: export with a --tp-degree that divides {kv} or that {kv} divides"
            )
        self.layout = layout
        eps, width = spec.rms_norm_eps, spec.target_hidden_size
        if spec.norm_before_fc:
            self.input_norm = rms_norm(spec.aux_width, eps, False)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(rms_norm(width, eps, False) for _ in spec.aux_layer_ids)
        self.fc = kernels.linear(spec.aux_width, spec.hidden_size, False)  # replicated: no suffix rule
        self.layers = nn.ModuleList([Eagle3Layer(spec, layout, layers, kernels)])
        self.norm = rms_norm(spec.hidden_size, eps, False)
        self.rotary_emb = Rotary(spec.head_dim)
        if "embed_tokens" not in spec.shares:
            self.embed_tokens = layers.embedding(spec.vocab_size, spec.hidden_size)
        if "lm_head" not in spec.shares:  # the vocabulary padded for tp, as the target's (parallel.py)
            padded = ceil_div(spec.draft_vocab_size, layers.tp_degree) * layers.tp_degree
            self.lm_head = layers.column(spec.hidden_size, padded, bias=False, gather_output=True)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Aux states [..., n * Ht] -> the head's hidden [..., H] (vLLM 0.32 combine_hidden_states)."""
        if self.spec.norm_before_fc:
            aux = self.input_norm(aux)
        if self.spec.fc_norm:
            chunks = aux.chunk(len(self.fc_norm), -1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(aux)

    def forward(self, embeds, hidden, parts, cache: KVCache) -> tuple:
        """embeds, hidden [1, R, H] -> (output [1, R, H] for the logits, the hidden the next
        step carries, the cache written)."""
        x, cache = self.layers[0](embeds, hidden, parts, cache)
        out = self.norm(x)
        return out, out if self.spec.norm_output else x, cache

    def logits(self, out: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """[..., H] -> draft-vocabulary logits [..., draft_vocab] (float32)."""
        lm_head = target_lm_head if "lm_head" in self.spec.shares else self.lm_head
        return lm_head(out)[..., : self.spec.draft_vocab_size].float() * self.spec.logit_scale

    def target_ids(self, out: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Greedy drafts as target ids: argmax over the draft vocabulary, plus d2t."""
        draft = torch.argmax(self.logits(out, target_lm_head), dim=-1)
        return draft + self.d2t[draft]


def attach_head(model, spec: Eagle3Spec, layers, rows: int) -> None:
    """The head as `model.draft`, in the model's dtype (its rotary fp32), with its buffers on the
    model: the head's one-layer KV pool (kv_layout.KVLayout.draft) and the aux states of the
    last call, [rows (aux_rows), n * Ht] (rows in the call's row-major token order)."""
    kv = model.kv
    model.draft = Eagle3Head(spec, model.layout, layers, model.kernels).to(kv.dtype)
    model.draft.rotary_emb.float()
    shape = (kv.num_blocks, model.draft.layout.kv_heads_per_rank, kv.draft.block_size, spec.head_dim)
    for name in ("draft_k_cache", "draft_v_cache"):
        model.register_buffer(name, torch.zeros(shape, dtype=kv.pool_dtype), persistent=False)
    aux = torch.zeros(rows, spec.aux_width, dtype=kv.dtype)
    model.register_buffer("aux_states", aux, persistent=False)


def draft_cache_names(model) -> list[str]:
    return ["draft_k_cache", "draft_v_cache", "aux_states"] if model.eagle3 is not None else []


def draft_cache(model) -> KVCache:
    kv = model.kv
    return KVCache(
        model.draft_k_cache, model.draft_v_cache, kv.draft, model.functional_cache, kv.draft_storage
    )


def keep_draft_cache(model, cache: KVCache) -> None:
    if model.functional_cache:  # XLA: the buffers reassigned (decoder.py: functional_cache)
        model.draft_k_cache, model.draft_v_cache = cache.keys, cache.values


def keep_aux_states(model, states: torch.Tensor) -> None:
    """The call's aux states [R, n * Ht] into rows [0, R) of `model.aux_states`."""
    rows = states.shape[0]
    if model.functional_cache:
        model.aux_states = torch.cat([states, model.aux_states[rows:]])
    else:
        model.aux_states[:rows] = states


def head_pass(model, ids, positions, tables, hidden, window: int, decode_rows: bool) -> tuple:
    """One pass of the head over rows [N, T] (hidden [N, T, H]): its K/V written at `positions`
    of the rows' blocks, then attention over its pool like a target layer's -> (output,
    carried hidden), each [N, T, H]."""
    head, (n, t) = model.draft, ids.shape
    embed = model.model.embed_tokens if "embed_tokens" in head.spec.shares else head.embed_tokens
    embeds = embed(ids.reshape(1, -1))
    read = model.kernels.cache_read(model.kv, positions, tables, window, decode_rows)
    rotary = (head.rotary_emb.cos_sin(positions, embeds.dtype), None)
    part = GraphPart(positions, tables, read, decode_rows, rotary)
    out, carried, cache = head(embeds, hidden.reshape(1, n * t, -1), (part,), draft_cache(model))
    keep_draft_cache(model, cache)
    return out.view(n, t, -1), carried.view(n, t, -1)


def propose(
    model, input_ids, position_ids, tables_and_slot, last_index, window: int, decode_rows: bool, steps: int
) -> torch.Tensor:
    """Drafts [N, steps] (target ids, int64) for rows [N, T] whose aux states the previous call
    left in `model.aux_states` (same rows, same order, same padding): the first pass over every
    token, then steps - 1 recurrent steps from index `last_index` [N] of each row."""
    n, t = input_ids.shape
    ids, positions = input_ids.long(), position_ids.long()
    # the head runs no adapter: a LoRA export's slot column dropped (lora.py)
    tables, _ = split_tables(tables_and_slot.long(), model.lora_spec)
    last_index = last_index.long()
    hidden = model.draft.combine(model.aux_states[: n * t].view(n, t, -1))
    out, carried = head_pass(model, ids, positions, tables, hidden, window, decode_rows)
    rows = torch.arange(n, device=ids.device)
    out, carried, position = out[rows, last_index], carried[rows, last_index], positions[rows, last_index]
    token = model.draft.target_ids(out, model.lm_head)
    drafts = [token]
    for step in range(1, steps):
        # A position at or past the sequence is never written: the step writes at S - 1 instead,
        # which only this chain reads before a later pass rewrites it (or the row has no room
        # left); its drafts are past the sequence, and the host drops them.
        at = chain_top(position, step + 1, model.kv.sequence_length)[:, None]
        out, carried = head_pass(model, token[:, None], at, tables, carried[:, None], window, True)
        out, carried = out[:, 0], carried[:, 0]
        token = model.draft.target_ids(out, model.lm_head)
        drafts.append(token)
    return torch.stack(drafts, dim=1)


def head_state(spec: Eagle3Spec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A head checkpoint's tensors -> the decoder's `draft.*` weights: names mapped, shared
    weights dropped, d2t as int64 (zeros where draft and target vocabularies are one), the
    rotary buffers computed from the head's config."""
    state = {}
    for name, tensor in tensors.items():
        ours = head_weight_name(name)
        if ours is not None and ours.removeprefix(f"{DRAFT}.").split(".")[0] not in spec.shares:
            state[ours] = tensor
    d2t = state.pop(f"{DRAFT}.d2t", None)
    if d2t is None and spec.draft_vocab_size != spec.vocab_size:
        raise Eagle3FitError(f"a head of {spec.draft_vocab_size} draft tokens needs its d2t (none found)")
    zeros = torch.zeros(spec.draft_vocab_size, dtype=torch.long)  # one vocabulary: the identity
    state[f"{DRAFT}.d2t"] = zeros if d2t is None else d2t.long()
    state |= {f"{DRAFT}.rotary_emb.{k}": v for k, v in spec.rotary().items()}
    return state


def d2t_error(spec: Eagle3Spec, d2t: torch.Tensor) -> str | None:
    """Why d2t cannot map the head's drafts to target ids (draft + d2t[draft] in [0, vocab_size):
    `target_ids` indexes the target's vocabulary with them), or None."""
    if tuple(d2t.shape) != (spec.draft_vocab_size,):
        return f"its d2t is {list(d2t.shape)}, not [{spec.draft_vocab_size}] (draft_vocab_size)"
    ids = torch.arange(spec.draft_vocab_size) + d2t.long()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= spec.vocab_size:
        return f"draft ids + d2t span {low}..{high}, outside the target's vocabulary [0, {spec.vocab_size})"
    return None


def shared_weights(
    tensors: dict[str, torch.Tensor], target_embed: torch.Tensor | None = None
) -> tuple[str, ...]:
    """What the head takes from the target: a missing embed_tokens or lm_head, and an
    embed_tokens equal to the target's (vLLM 0.32 llm_base_proposer._maybe_share_embeddings)."""
    named = {head_weight_name(n): t for n, t in tensors.items()}
    embed = named.get(f"{DRAFT}.embed_tokens.weight")
    same = embed is not None and target_embed is not None and torch.equal(embed, target_embed.to(embed.dtype))
    return tuple(s for s in SHAREABLE if f"{DRAFT}.{s}.weight" not in named or (s == "embed_tokens" and same))

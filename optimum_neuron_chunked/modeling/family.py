"""What distinguishes the supported llama-family architectures, read off an HF config."""

from __future__ import annotations

from dataclasses import dataclass

from .layers import ACTIVATIONS
from .moe import MoeSpec, moe_spec

# model_type -> HF architecture class name
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class FamilySpec:
    """Shapes and per-family deltas of a llama-like decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    qkv_bias: bool = False  # qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k, before rotary
    attention_scale: float | None = None  # granite: attention_multiplier; default 1/sqrt(head_dim)
    embedding_multiplier: float = 1.0  # granite
    residual_multiplier: float = 1.0  # granite
    logits_divisor: float = 1.0  # granite: logits_scaling
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    rope_layers: tuple[bool, ...] = ()  # smollm3: per layer, False = no rotary (NoPE); () = all
    fused_projections: bool = False  # phi3: qkv_proj and gate_up_proj, split at load
    gemma_norms: bool = False  # gemma3: RMSNorm weights offset from 1; norms before and after attn/MLP
    local_rope: bool = False  # gemma3: sliding layers use their own rotary (rotary_emb_local)
    final_logit_softcap: float | None = None  # gemma3: logits = cap * tanh(logits / cap)
    moe: MoeSpec | None = None  # qwen3_moe, mixtral, gpt_oss: sparse expert MLPs
    attention_sinks: bool = False  # gpt_oss: a learned logit per head joins every softmax

    def uses_rope(self, layer_idx: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer_idx]

    def dense_mlp(self, layer_idx: int) -> bool:
        """Layer `layer_idx` has the family's dense MLP, not a mixture of experts (which takes no
        LoRA adapters)."""
        return self.moe is None or not self.moe.sparse_layers[layer_idx]

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5


def family_spec(config) -> FamilySpec:
    """Read a FamilySpec off a transformers PretrainedConfig; refuse what we do not support."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = getattr(config, "architectures", None) or [model_type]
        raise UnsupportedArchitectureError(
            f"architecture {archs[0]!r} (model_type {model_type!r}) is not supported; supported: "
            + ", ".join(f"{a} ({t})" for t, a in SUPPORTED_ARCHITECTURES.items())
        )
    _refuse_unsupported_rope(config)
    gemma = model_type == "gemma3_text"
    if gemma:
        _refuse_unsupported_gemma(config)
    act = getattr(config, "hidden_activation", None) if gemma else getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})."
        )
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    granite = model_type == "granite"
    return FamilySpec(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        hidden_act=act,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        attention_scale=_attention_scale(config),
        embedding_multiplier=_embedding_multiplier(config),
        residual_multiplier=config.residual_multiplier if granite else 1.0,
        logits_divisor=config.logits_scaling if granite else 1.0,
        sliding_windows=_sliding_windows(config),
        rope_layers=_rope_layers(config),
        fused_projections=model_type == "phi3",
        gemma_norms=gemma,
        local_rope=gemma,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        moe=moe_spec(config),
        attention_sinks=model_type == "gpt_oss",
    )


def _attention_scale(config) -> float | None:
    if config.model_type == "granite":
        return config.attention_multiplier
    if config.model_type == "gemma3_text":
        return config.query_pre_attn_scalar**-0.5
    return None


def _embedding_multiplier(config) -> float:
    if config.model_type == "granite":
        return config.embedding_multiplier
    if config.model_type == "gemma3_text":  # Gemma3TextScaledWordEmbedding
        return config.hidden_size**0.5
    return 1.0


def _refuse_unsupported_gemma(config) -> None:
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitectureError(
            "gemma3_text with attn_logit_softcapping is not supported (Gemma3 checkpoints leave it unset)."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(
            "gemma3_text with use_bidirectional_attention (an embedding model) is not supported: "
            "generation needs causal attention."
        )


def _sliding_windows(config) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    # qwen2 and smollm3 slide only with use_sliding_window (their attention modules check it)
    if window is None or not getattr(config, "use_sliding_window", True):
        return (None,) * n
    if layer_types is None:  # mistral: every layer slides
        return (window,) * n
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _rope_layers(config) -> tuple[bool, ...]:
    """smollm3's no_rope_layers: 1 = the layer applies rotary (SmolLM3Attention.use_rope)."""
    flags = getattr(config, "no_rope_layers", None) if config.model_type == "smollm3" else None
    return tuple(bool(flags[i]) for i in range(config.num_hidden_layers)) if flags else ()


def _refuse_unsupported_rope(config) -> None:
    """Rotary variants whose frequencies depend on the sequence length at run time, or that
    rotate part of each head, are refused by name rather than computed wrongly."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # gemma3 (transformers 5.x): one set of parameters per layer type
    for nested in [p for p in params.values() if isinstance(p, dict)]:
        _refuse_rope_params(config, nested)
    _refuse_rope_params(config, params)


def _refuse_rope_params(config, params: dict) -> None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if rope_type in ("longrope", "su", "dynamic"):
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} ({config.model_type}) is not supported: its frequencies change with "
            "the sequence length at run time; use the model's short-context variant (e.g. Phi-3-mini-4k)."
        )
    if partial != 1.0:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor {partial} ({config.model_type}) is not supported: rotary over whole heads only."
        )

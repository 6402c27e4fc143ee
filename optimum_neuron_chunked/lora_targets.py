"""The projections LoRA adapters may target, as users and vLLM name them (the ground floor:
config.py resolves --lora-target-modules with it, modeling/lora.py builds the slots) and the
names of the slot parameters."""

from __future__ import annotations

from collections.abc import Iterable

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")  # dense MLPs: MoE experts take no adapters
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# The attribute of an attention or MLP block holding its projections' adapter slots: a slot
# parameter is `<block>.lora.<projection>.a` / `.b` (modeling/lora.LoraSlots).
SLOTS = "lora"
# vLLM's packed names (and phi3's fused modules) for the sets they stand for
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def resolve_targets(names: Iterable[str]) -> tuple[str, ...]:
    """Module names as users type them (comma or space separated, packed names allowed) -> the
    projections, in the decoder's order; none given: every projection. Raises ValueError."""
    names = [n.strip() for name in names for n in name.split(",") if n.strip()]
    if not names:
        return TARGETS
    wanted = set()
    for name in names:
        expanded = PACKED.get(name, (name,))
        if any(n not in TARGETS for n in expanded):
            raise ValueError(
                f"--lora-target-modules {name}: not a projection adapters can target; choose among "
                f"{', '.join(TARGETS + tuple(PACKED))}."
            )
        wanted.update(expanded)
    return tuple(t for t in TARGETS if t in wanted)


def slot_name(block: str, projection: str, tensor: str) -> str:
    """The name of slot tensor `tensor` ("a" or "b") of `projection` in module `block`
    (e.g. model.layers.0.self_attn)."""
    return f"{block}.{SLOTS}.{projection}.{tensor}"


def is_slot(name: str) -> bool:
    """`name` (a parameter's or a module's) is an adapter slot's, or holds adapter slots."""
    return f".{SLOTS}." in name

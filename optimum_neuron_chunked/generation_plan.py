"""generate()'s arguments as transformers takes them, resolved into one plan: sampling on the
device (greedy, temperature, top-k, top-p: the graphs' own sampler) or on the host, through
transformers' own logits processors, where an argument asks for what the device sampler cannot
do (min_new_tokens, repetition_penalty, ... - as the vLLM path samples such requests on the
host). An argument the plan cannot honour is refused by name, never ignored."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

# GenerationConfig fields the plan reads; any other field set away from its default is refused.
HANDLED = {
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
    "pad_token_id", "bos_token_id", "min_new_tokens", "min_length", "repetition_penalty",
    "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "stop_strings",
    "prompt_lookup_num_tokens", "use_cache", "num_beams", "num_return_sequences",
    "transformers_version", "_from_model_config", "decoder_start_token_id",
}  # fmt: skip


@dataclass
class GenerationPlan:
    config: GenerationConfig
    processors: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    stopping: StoppingCriteriaList = field(default_factory=StoppingCriteriaList)

    @property
    def on_host(self) -> bool:
        return bool(self.processors) or bool(self.stopping)

    def next_token(self, ids: torch.Tensor, logits: torch.Tensor, generator) -> int:
        """Host sampling of one row: ids [1, L] (the padded prompt and the new tokens), logits [V]."""
        scores = self.processors(ids, logits[None].float())
        if self.config.do_sample:
            scores = _warp(self.config, ids, scores)
            return int(torch.multinomial(scores.softmax(-1), 1, generator=generator)[0, 0])
        return int(scores.argmax(-1)[0])

    def stops(self, ids: torch.Tensor, logits: torch.Tensor) -> bool:
        return bool(self.stopping) and bool(self.stopping(ids, logits[None].float())[0])


def plan(defaults: GenerationConfig, generation_config: GenerationConfig | None, prompt_length: int,
         logits_processor=None, stopping_criteria=None, tokenizer=None, **kwargs) -> GenerationPlan:  # fmt: skip
    """The plan of one generate() call: the model's generation config, updated by the one given
    and by keyword arguments (as transformers merges them)."""
    config = copy.deepcopy(generation_config or defaults)
    unused = config.update(**kwargs)
    if unused:
        raise TypeError(f"generate() got arguments it does not take: {', '.join(sorted(unused))}.")
    given = set(kwargs) | (_set_fields(generation_config) if generation_config is not None else set())
    _refuse_unhandled(config, given)
    processors = _processors(config, prompt_length) + list(logits_processor or [])
    stopping = list(stopping_criteria or [])
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass generate(..., tokenizer=tokenizer).")
        from transformers import StopStringCriteria

        stopping.append(StopStringCriteria(tokenizer, config.stop_strings))
    return GenerationPlan(config, LogitsProcessorList(processors), StoppingCriteriaList(stopping))


def _set_fields(config: GenerationConfig) -> set[str]:
    """The fields of `config` away from their defaults."""
    default = GenerationConfig().to_dict()
    return {k for k, v in config.to_dict().items() if v != default.get(k) and v not in (None, False)}


def _refuse_unhandled(config: GenerationConfig, given: set[str]) -> None:
    """Refuse what the caller asked for and the plan cannot do; a field the checkpoint's own
    generation config sets (e.g. gemma3's cache_implementation) concerns transformers' model,
    not this one, and is left alone."""
    refused = sorted(k for k in _set_fields(config) & given if k not in HANDLED)
    if (config.num_beams or 1) != 1 or (config.num_return_sequences or 1) != 1:
        refused += ["num_beams / num_return_sequences (one sequence a prompt, no beam search)"]
    if refused:
        raise ValueError(f"generate() does not support: {', '.join(refused)}.")


def _processors(config: GenerationConfig, prompt_length: int) -> list:
    from transformers import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    eos = config.eos_token_id
    out = []
    if config.min_new_tokens and eos is not None:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos))
    if config.min_length and eos is not None:
        out.append(MinLengthLogitsProcessor(config.min_length, eos))
    if config.repetition_penalty not in (None, 1.0):
        out.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        out.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids:
        out.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.suppress_tokens:
        out.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
    return out


def _warp(config: GenerationConfig, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if config.temperature not in (None, 1.0):
        scores = TemperatureLogitsWarper(config.temperature)(ids, scores)
    if config.top_k:
        scores = TopKLogitsWarper(config.top_k)(ids, scores)
    if config.top_p not in (None, 1.0):
        scores = TopPLogitsWarper(config.top_p)(ids, scores)
    return scores

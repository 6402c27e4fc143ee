"""The export configuration: the one source of truth for every compiled shape."""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .lora_targets import resolve_targets
from .version import __version__

CONFIG_NAME = "neuron_config.json"
# xla: the neuron backend's graphs on torch-xla's device (no neuronx-cc, no Neuron runtime)
BACKENDS = ("cpu", "eager", "neuron", "xla")
DTYPES = ("float32", "bfloat16", "float16")
INSTANCE_TYPES = ("trn1", "inf2", "trn2")  # backends/neuron/target.py TARGETS (a test checks)
ATTENTION_KERNELS = ("auto", "nki", "reference")
QUANTIZATIONS = ("int8", "fp8")  # weight-only, symmetric (modeling/quantization.py)
KV_CACHE_DTYPES = ("auto", "fp8")  # fp8: float8_e4m3fn within Neuron's +-240 (modeling/kv_cache.py)
# Smallest context bucket chosen by default: below this a smaller graph saves little.
MIN_DEFAULT_BUCKET = 512
DEFAULT_LORA_RANK = 16  # --max-lora-rank when not given
# Keys of neuron_config.json renamed since: exports written before keep the old ones.
RENAMED_KEYS = {"prompt_logits": "prompt_logprobs"}


def option(
    *flags: str,
    default: Any = dataclasses.MISSING,
    help: str | None = None,
    choices: tuple[str, ...] | None = None,
    resolved: bool = False,
    comma_list: bool = False,
) -> Any:
    """A NeuronConfig field that is an export option: a keyword of export() and a flag of
    `optimum-cli export neuron` (export/cli.py builds the parser from it).

    `flags`: the spellings users type, the first shown by --help; a bool defaulting to True
    has one flag that turns it off. `resolved`: export() and the CLI default to None, which
    the export resolves on its host; the field's own default is for configs built by hand.
    `comma_list`: a tuple of names typed as one comma-separated word (not PATTERN...)."""
    metadata = {
        "flags": flags,
        "help": help,
        "choices": choices,
        "resolved": resolved,
        "comma_list": comma_list,
    }
    return field(default=default, metadata=metadata)


class NeuronConfigError(ValueError):
    """An export configuration that cannot be compiled; the message says what to change."""


class InvalidExportError(ValueError):
    """A folder that is not a complete export of this package version for this backend."""


@dataclass(frozen=True)
class NeuronConfig:
    """Compiled shapes and options of one export.

    prefill_chunk_size == 0 selects the standard recipe: context-encoding (CE) graphs as wide
    as the prompt buckets. Otherwise chunked-prefill (CP) graphs of width prefill_chunk_size.
    Both come with token-generation (TG) graphs. Every graph exists once per context bucket:
    a step attends only over the smallest bucket that covers its live context.
    prefill_widths: the CP graph widths, the chunk size the largest; a chunk runs in the
    narrowest that holds it (short chunks: a prompt's last, a prefix hit's suffix).
    decode_widths: the TG graph widths (rows), batch_size the largest; a decode step runs in
    the narrowest that holds its rows, so a step with few running requests does not compute
    the whole batch.
    mixed_step: MX graphs (one per bucket) run a step's decode rows and a full chunk in one
    call, reading every weight once for both (Sarathi-Serve's piggybacked decodes).
    speculation_length K: VF graphs (per bucket and decode width) take decode rows of K + 1
    tokens - the last token and up to K drafts - and score every position.
    kv_cache_blocks / kv_block_size (paged exports): the KV cache is one pool of blocks of P
    positions that every request draws from (the default: one whole-sequence block per batch
    row); batch_size keeps counting the decode rows of TG graphs, and there is no copy graph
    (prefix caching shares blocks instead).
    """

    # Export options, in --help order.
    batch_size: int = option(
        "--batch_size",
        "--batch-size",
        help="Max concurrent sequences (decode rows; one whole-sequence KV block each by default).",
    )
    sequence_length: int = option("--sequence_length", "--sequence-length", help="Max tokens per sequence.")
    prefill_chunk_size: int = option(
        "--prefill-chunk-size",
        "--prefill_chunk_size",
        default=0,
        help="Width C of the chunked-prefill graph; 0 (default) compiles the standard context-encoding graph.",
    )
    backend: str = option(
        "--backend",
        default="cpu",
        choices=BACKENDS,
        resolved=True,
        help="What the graphs compile for (default: neuron where the Neuron SDK is importable, else cpu).",
    )
    dtype: str = option("--dtype", "--torch_dtype", default="float32", choices=DTYPES)
    on_device_sampling: bool = option(
        "--no-on-device-sampling",
        default=True,
        help="TG graphs return logits only; sampling happens on the host.",
    )
    prompt_logprobs: bool = option(
        "--prompt-logprobs",
        "--prompt_logprobs",
        default=False,
        help="Prefill graphs return every position's logits, so vLLM can serve prompt_logprobs "
        "(evaluation harnesses); costs a [C, V] (chunked) or [P, V] (standard) output per call.",
    )
    tp_degree: int = option("--tensor_parallel_size", "--tensor-parallel-size", default=1)
    instance_type: str = option(
        "--instance_type",
        "--instance-type",
        default="",  # set with the neuron backend only
        choices=INSTANCE_TYPES,
        resolved=True,
        help="Neuron backend: the instance the graphs are compiled for (default: this host's).",
    )
    max_topk: int = option(
        "--max-topk", "--max_topk", default=256, help="Candidates considered by on-device sampling."
    )
    context_buckets: tuple[int, ...] = option(
        "--context-buckets",
        "--context_buckets",
        default=(),
        help="Comma-separated context buckets (default: sequence_length halved down to 512).",
    )
    prefill_widths: tuple[int, ...] = option(
        "--prefill-widths",
        "--prefill_widths",
        default=(),
        help="Comma-separated CP graph widths, the chunk size the largest (default: the chunk size "
        "alone). A chunk runs in the narrowest that holds it: short chunks (a prompt's last, a "
        "prefix-cache hit's suffix) cost less, each width adds one graph per context bucket.",
    )
    decode_widths: tuple[int, ...] = option(
        "--decode-widths",
        "--decode_widths",
        default=(),
        help="Comma-separated TG graph widths in rows, the batch size the largest (default: the batch "
        "size alone). A decode step runs in the narrowest that holds its rows: steps with few running "
        "requests cost less, each width adds one graph per context bucket.",
    )
    mixed_step: bool = option(
        "--mixed-step",
        "--mixed_step",
        default=False,
        help="With --prefill-chunk-size: add an MX graph per context bucket that runs a step's decodes "
        "and a full prefill chunk in one call, reading every weight once for both (default: off; "
        "decodes and chunks run in their own TG and CP calls).",
    )
    speculation_length: int = option(
        "--speculation-length",
        "--speculation_length",
        default=0,
        help="Add verify graphs (one per context bucket and decode width) that score a decode row's "
        "last token and up to K drafted tokens in one call, for vLLM's n-gram speculative decoding "
        "(--speculative-config); 0 (default): none.",
    )
    speculation_head: str = option(
        "--speculation-head",
        "--speculation_head",
        default="",
        help="An EAGLE3 head (a folder or Hub id: yuhuili's LlamaForCausalLMEagle3 or speculators' "
        "Eagle3Speculator) compiled beside the target, with --speculation-length K and "
        "--prefill-chunk-size: draft graphs propose K tokens a row on the device from the target's "
        "hidden states (vLLM's eagle3 method; the export keeps the head's config in eagle3_head/).",
    )
    kv_cache_blocks: int = option(
        "--kv-cache-blocks",
        "--kv_cache_blocks",
        default=0,
        help="With --prefill-chunk-size and --kv-block-size: a pool of N KV blocks shared by all "
        "requests (paged KV; vLLM allocates them); 0 (default): one whole-sequence block per "
        "batch row.",
    )
    kv_block_size: int = option(
        "--kv-block-size",
        "--kv_block_size",
        default=0,
        help="Positions per KV block of --kv-cache-blocks; divides every context bucket.",
    )
    attention_kernel: str = option(
        "--attention-kernel",
        "--attention_kernel",
        default="auto",
        choices=ATTENTION_KERNELS,
        help="Neuron backend: prefill chunks (CP, MX's chunk, CE) attend through AWS's NKI kernel "
        "nkilib attention_cte - auto: where nkilib imports and the graph fits it (bf16, head_dim <= "
        "128), else the reference; nki: refused where it cannot; reference: never. Decode rows "
        "always run the reference.",
    )
    quantization: str = option(
        "--quantization",
        default="",
        choices=QUANTIZATIONS,
        resolved=True,
        help="Store the attention and MLP projections and MoE experts as int8 or fp8 weights with a "
        "float32 scale per output channel (weight-only; embeddings, lm_head, routers and norms keep "
        "--dtype): half the weight bytes a decode step reads. Default: none, except for an FP8 "
        "checkpoint, exported as fp8 (its own scales, per channel or block-wise).",
    )
    quantization_skip: tuple[str, ...] = option(
        "--quantization-skip",
        "--quantization_skip",
        default=(),
        help="With --quantization: modules kept in --dtype, with the modules they hold: a name suffix "
        "at a dot (down_proj, layers.0.mlp) or a glob over the whole name ('model.layers.1?.*'); end "
        "the patterns with -- when OUT follows.",
    )
    kv_cache_dtype: str = option(
        "--kv-cache-dtype",
        "--kv_cache_dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="The KV pool's storage: auto (--dtype) or fp8 (float8 e4m3, half the bytes of bf16: twice the "
        "tokens in the same memory), scaled per layer by the checkpoint's K / V scales where it has them, else 1.",
    )
    max_loras: int = option(
        "--max-loras",
        "--max_loras",
        default=0,
        help="LoRA adapter slots compiled into every graph: rows of up to N adapters share one call, "
        "adapters are written into the slots at run time (vLLM --enable-lora, model.load_adapter); "
        "0 (default): none.",
    )
    max_lora_rank: int = option(
        "--max-lora-rank",
        "--max_lora_rank",
        default=DEFAULT_LORA_RANK,
        help="With --max-loras: the largest adapter rank a slot holds (smaller ranks are zero-padded).",
    )
    lora_target_modules: tuple[str, ...] = option(
        "--lora-target-modules",
        "--lora_target_modules",
        default=(),
        comma_list=True,
        help="With --max-loras: the projections that get slots, comma-separated (q_proj,k_proj,v_proj,"
        "o_proj,gate_proj,up_proj,down_proj; vLLM's qkv_proj and gate_up_proj stand for their sets). "
        "Default: every attention and dense MLP projection.",
    )
    # Recorded by the export.
    quantization_block: tuple[int, ...] = ()  # FP8 checkpoints' block-wise scales: (rows, columns)
    nki_attention: tuple[str, ...] = ()  # graphs whose prefill chunks run nkilib's attention_cte
    # fp8 KV: per layer (K scale, V scale), the checkpoint's fitted into +-240; () = 1.0 (direct cast)
    kv_cache_scales: tuple[tuple[float, float], ...] = ()
    # the kernel limits that chose them (backends/neuron/attention_choice.KernelLimits)
    nki_limits: dict = field(default_factory=dict, compare=False, hash=False)
    speculation_head_digest: str = ""  # the head's config and weights (head_checkpoint.head_digest)
    speculation_head_shares: tuple[str, ...] = ()  # weights the head takes from the target (eagle3.py)
    cpu_isa: str = ""  # cpu backend: the vector ISA of the host that compiled (AVX2, AVX512, ...)
    model_type: str = ""
    package_version: str = __version__
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.context_buckets:
            object.__setattr__(self, "context_buckets", default_buckets(self))
        object.__setattr__(self, "context_buckets", tuple(sorted(set(self.context_buckets))))
        widths = self.prefill_widths or ((self.prefill_chunk_size,) if self.chunked else ())
        object.__setattr__(self, "prefill_widths", tuple(sorted(set(widths))))
        object.__setattr__(
            self, "decode_widths", tuple(sorted(set(self.decode_widths or (self.batch_size,))))
        )
        for name in ("quantization_skip", "quantization_block", "speculation_head_shares"):  # lists given
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "kv_cache_scales", tuple(tuple(map(float, s)) for s in self.kv_cache_scales))
        if self.has_lora_slots:  # as typed -> the projections, in the decoder's order (modeling/lora.py)
            try:
                object.__setattr__(self, "lora_target_modules", resolve_targets(self.lora_target_modules))
            except ValueError as e:
                raise NeuronConfigError(str(e)) from None
        self._validate()

    def _validate(self) -> None:
        """Every rule of the options, step by step; each error names the flag to change."""
        self._validate_ranges()
        self._validate_backend()
        self._validate_widths()
        self._validate_speculation()
        self._validate_quantization()
        self._validate_attention_kernel()
        if self.context_buckets[0] < max(self.prefill_chunk_size, 1):
            raise NeuronConfigError(
                f"context bucket {self.context_buckets[0]} is smaller than the chunk size "
                f"{self.prefill_chunk_size}: every bucket must hold at least one chunk."
            )
        self._validate_paged()
        self._validate_lora()
        self._validate_kv_cache_dtype()

    def _validate_ranges(self) -> None:
        def fail(msg: str) -> None:
            raise NeuronConfigError(msg)

        if self.batch_size < 1:
            fail(f"batch_size must be >= 1, got {self.batch_size}: pass --batch_size 1 or more.")
        if self.sequence_length < 2:
            fail(
                f"sequence_length must be >= 2, got {self.sequence_length}: pass a larger --sequence_length."
            )
        if self.prefill_chunk_size < 0:
            fail(
                f"prefill_chunk_size must be >= 0 (0 = standard context encoding), got {self.prefill_chunk_size}."
            )
        if self.prefill_chunk_size > self.sequence_length:
            fail(
                f"prefill_chunk_size ({self.prefill_chunk_size}) exceeds sequence_length ({self.sequence_length}): "
                f"pass --prefill-chunk-size <= {self.sequence_length}, or 0 for the standard graph."
            )
        if self.tp_degree < 1:
            fail(f"tp_degree must be >= 1, got {self.tp_degree}.")
        if self.dtype not in DTYPES:
            fail(f"dtype {self.dtype!r} is not supported: choose one of {', '.join(DTYPES)}.")

    def _validate_backend(self) -> None:
        def fail(msg: str) -> None:
            raise NeuronConfigError(msg)

        if self.backend not in BACKENDS:
            fail(f"backend {self.backend!r} is not supported: choose one of {', '.join(BACKENDS)}.")
        if (self.backend == "neuron") != bool(self.instance_type):
            fail(
                "instance_type goes with the neuron backend and only with it: pass --instance_type "
                f"trn1|inf2|trn2 with --backend neuron (got backend {self.backend!r}, instance_type "
                f"{self.instance_type!r})."
            )
        if self.tp_degree > 1 and self.backend != "neuron":
            fail(
                f"--tensor_parallel_size {self.tp_degree} needs --backend neuron (cpu, eager and xla run on one process)."
            )

    def _validate_widths(self) -> None:
        """The compiled shapes: the sampler's top-k, buckets up to the sequence, chunk and decode
        widths, mixed steps."""

        def fail(msg: str) -> None:
            raise NeuronConfigError(msg)

        if self.max_topk < 1:
            fail(f"max_topk must be >= 1, got {self.max_topk}.")
        if self.context_buckets[-1] != self.sequence_length:
            fail(
                f"the largest context bucket must equal sequence_length ({self.sequence_length}), "
                f"got buckets {list(self.context_buckets)}."
            )
        if self.prefill_widths and (
            not self.chunked
            or self.prefill_widths[-1] != self.prefill_chunk_size
            or self.prefill_widths[0] < 1
        ):
            fail(
                f"prefill widths {list(self.prefill_widths)} must be chunk widths from 1 up to the chunk "
                f"size, the chunk size included: pass --prefill-widths with --prefill-chunk-size "
                f"{self.prefill_chunk_size or 'C'} as the largest."
            )
        if self.decode_widths[-1] != self.batch_size or self.decode_widths[0] < 1:
            fail(
                f"decode widths {list(self.decode_widths)} must be row counts from 1 up to the batch "
                f"size, the batch size included: pass --decode-widths with --batch_size "
                f"{self.batch_size} as the largest."
            )
        if self.mixed_step and not self.chunked:
            fail(
                "--mixed-step runs decodes with a prefill chunk in one graph: it needs a chunked "
                "export, pass --prefill-chunk-size too."
            )

    def _validate_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise NeuronConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype}: choose one of {', '.join(KV_CACHE_DTYPES)}."
            )
        if self.kv_cache_scales and self.kv_cache_dtype != "fp8":
            raise NeuronConfigError("KV-cache scales go with --kv-cache-dtype fp8.")

    def _validate_lora(self) -> None:
        slots, rank = self.max_loras, self.max_lora_rank
        if slots < 0 or (slots and rank < 1):
            raise NeuronConfigError(
                f"--max-loras {slots} --max-lora-rank {rank}: pass --max-loras N >= 1 with --max-lora-rank r >= 1 "
                "(adapter slots), or --max-loras 0 for none."
            )
        if (self.lora_target_modules or rank != DEFAULT_LORA_RANK) and not self.has_lora_slots:
            raise NeuronConfigError(
                "--max-lora-rank and --lora-target-modules shape adapter slots: pass --max-loras N too."
            )

    def _validate_speculation(self) -> None:
        k = self.speculation_length
        if k < 0:
            raise NeuronConfigError(f"--speculation-length must be >= 0 (0: no verify graphs), got {k}.")
        # A sliding layer's ring holds window + C positions: a call writes at most C (kv_layout.KVLayout.of).
        most = min(self.prefill_chunk_size or self.sequence_length, self.context_buckets[0]) - 1
        if k > most:
            raise NeuronConfigError(
                f"--speculation-length {k} verifies {k + 1} tokens a row, more than the chunk size and "
                f"the smallest context bucket allow: pass --speculation-length <= {most}."
            )
        if k and self.mixed_step:
            raise NeuronConfigError(
                "--speculation-length and --mixed-step do not combine: verify rows run in their own VF "
                "graphs, never beside a chunk in an MX graph. Drop one of them."
            )
        if self.speculation_head and (not k or not self.chunked):
            raise NeuronConfigError(
                f"--speculation-head {self.speculation_head} drafts K tokens after each prefill chunk and "
                "verify step: pass --speculation-length K (1 or more) and --prefill-chunk-size C with it "
                f"(got --speculation-length {k}, --prefill-chunk-size {self.prefill_chunk_size})."
            )

    def _validate_attention_kernel(self) -> None:
        kernel = self.attention_kernel
        if kernel not in ATTENTION_KERNELS:
            raise NeuronConfigError(
                f"--attention-kernel {kernel}: choose one of {', '.join(ATTENTION_KERNELS)}."
            )
        if kernel == "nki" and self.backend != "neuron":
            raise NeuronConfigError(
                f"--attention-kernel nki calls AWS's NKI kernel, which the neuron backend compiles: the "
                f"{self.backend} backend runs the reference attention (pass --attention-kernel auto, or --backend neuron)."
            )

    def _validate_quantization(self) -> None:
        if self.quantization not in ("", *QUANTIZATIONS):
            raise NeuronConfigError(
                f"--quantization {self.quantization}: choose one of {', '.join(QUANTIZATIONS)}."
            )
        if self.quantization_skip and not self.quantization:
            raise NeuronConfigError(
                "--quantization-skip names modules kept unquantized: pass it with --quantization int8|fp8."
            )
        if self.quantization_block and (self.quantization != "fp8" or len(self.quantization_block) != 2):
            raise NeuronConfigError(
                f"block-wise scales {list(self.quantization_block)} come with fp8 weights, as (rows, columns)."
            )

    def _validate_paged(self) -> None:
        blocks, size = self.kv_cache_blocks, self.kv_block_size
        if (blocks, size) != (0, 0) and not (min(blocks, size) > 0 and self.chunked):
            raise NeuronConfigError(
                f"--kv-cache-blocks ({blocks}) and --kv-block-size ({size}) page the KV cache of a chunked "
                "export: pass both, positive, with --prefill-chunk-size (a pool of N blocks of P "
                "positions), or neither (one whole-sequence block per batch row)."
            )
        # A block of S positions is a whole-sequence block, which only the absence of
        # --kv-block-size asks for (KVPool.whole_sequence_blocks reads P = S as that).
        if size == self.sequence_length:
            raise NeuronConfigError(
                f"--kv-block-size {size} is the whole --sequence_length: omit --kv-cache-blocks and "
                "--kv-block-size (one whole-sequence block per batch row), or pick a smaller P."
            )
        if any(bucket % size for bucket in self.context_buckets if size):
            raise NeuronConfigError(
                f"--kv-block-size {size} must divide every context bucket {list(self.context_buckets)} "
                f"and --sequence_length {self.sequence_length}: pick a divisor of them."
            )

    @property
    def chunked(self) -> bool:
        return self.prefill_chunk_size > 0

    @property
    def has_lora_slots(self) -> bool:
        """A LoRA export (--max-loras N): adapter slots beside its projections, and each row's
        slot as one more column of its block tables (modeling/lora.py)."""
        return bool(self.max_loras)

    @property
    def verify_width(self) -> int:
        """Tokens per row of a VF graph: the last token and up to speculation_length drafts."""
        return self.speculation_length + 1

    @property
    def prefill_width(self) -> int | None:
        """Width of the widest CP graph, or None for standard exports (CE width = its bucket)."""
        return self.prefill_chunk_size or None

    def width_for(self, tokens: int) -> int:
        """Narrowest compiled CP width that holds a chunk of `tokens` (chunked exports)."""
        return _smallest_cover(
            self.prefill_widths,
            tokens,
            f"a chunk of {tokens} tokens exceeds the chunk size {self.prefill_chunk_size}.",
        )

    def decode_width_for(self, rows: int) -> int:
        """Narrowest compiled TG width that holds a decode step of `rows` rows."""
        return _smallest_cover(
            self.decode_widths,
            rows,
            f"a decode step of {rows} rows exceeds the batch size {self.batch_size}.",
        )

    def bucket_for(self, context_length: int) -> int:
        """Smallest compiled bucket that holds `context_length` positions."""
        return _smallest_cover(
            self.context_buckets,
            context_length,
            f"context of {context_length} tokens exceeds the compiled sequence_length {self.sequence_length}.",
        )

    def export_command(self, out: str | Path, model: str = "M") -> str:
        """The `optimum-cli export neuron` command line that makes this export again: every
        option that differs from its default, by its first flag (export/cli.py parses them)."""
        words, patterns = ["optimum-cli", "export", "neuron", "--model", model], []
        for f in EXPORT_OPTIONS:
            value = getattr(self, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            if (
                f.type == "tuple[str, ...]" and not f.metadata["comma_list"]
            ):  # PATTERN...: last, ended by "--"
                patterns += [f.metadata["flags"][0], *value, "--"]
                continue
            words.append(f.metadata["flags"][0])
            if not isinstance(value, bool):
                words.append(",".join(map(str, value)) if isinstance(value, tuple) else str(value))
        return shlex.join([*words, *patterns, str(out)])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["context_buckets"] = list(self.context_buckets)
        d["prefill_widths"] = list(self.prefill_widths)
        d["decode_widths"] = list(self.decode_widths)
        d["nki_attention"] = list(self.nki_attention)
        d["quantization_skip"] = list(self.quantization_skip)
        d["quantization_block"] = list(self.quantization_block)
        d["lora_target_modules"] = list(self.lora_target_modules)
        d["kv_cache_scales"] = [list(s) for s in self.kv_cache_scales]
        d["speculation_head_shares"] = list(self.speculation_head_shares)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> NeuronConfig:
        d = {RENAMED_KEYS.get(k, k): v for k, v in d.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"files"})  # file records: integrity.py
        if unknown:
            raise NeuronConfigError(
                f"unknown fields in {CONFIG_NAME}: {unknown} (written by a newer version?)"
            )
        d = {k: v for k, v in d.items() if k in known}
        d["context_buckets"] = tuple(d.get("context_buckets", ()))
        d["prefill_widths"] = tuple(d.get("prefill_widths", ()))  # absent: the chunk size alone
        d["decode_widths"] = tuple(d.get("decode_widths", ()))  # absent: the batch size alone
        d["nki_attention"] = tuple(d.get("nki_attention", ()))
        d["quantization_skip"] = tuple(d.get("quantization_skip", ()))
        d["quantization_block"] = tuple(d.get("quantization_block", ()))
        d["lora_target_modules"] = tuple(d.get("lora_target_modules", ()))
        d["kv_cache_scales"] = tuple(tuple(s) for s in d.get("kv_cache_scales", ()))
        d["speculation_head_shares"] = tuple(d.get("speculation_head_shares", ()))
        return cls(**d)

    def save(self, directory: str | Path, files: dict[str, dict] | None = None) -> None:
        """Write neuron_config.json; `files`: the export's file records (integrity.py)."""
        d = self.to_dict() | ({"files": files} if files else {})
        Path(directory, CONFIG_NAME).write_text(json.dumps(d, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> NeuronConfig:
        path = Path(directory, CONFIG_NAME)
        if not path.is_file():
            raise NeuronConfigError(
                f"{directory} is not an export: {CONFIG_NAME} is missing. "
                "Create one with `optimum-cli export neuron --model M ... OUT`."
            )
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise NeuronConfigError(
                f"{path} is damaged (not JSON: {e}). Copy it again from the original export, or export again."
            ) from e
        return cls.from_dict(d)


# NeuronConfig's fields that export() and the CLI take, in --help order.
EXPORT_OPTIONS = tuple(f for f in dataclasses.fields(NeuronConfig) if "flags" in f.metadata)


def ceil_div(n, d: int):
    """ceil(n / d) of integers: the one spelling. `n` may be a SymInt (a graph's live width):
    no float, no negation."""
    return (n + d - 1) // d


def default_buckets(config: NeuronConfig) -> tuple[int, ...]:
    """Halve sequence_length down to max(MIN_DEFAULT_BUCKET, chunk size)."""
    floor = max(MIN_DEFAULT_BUCKET, config.prefill_chunk_size)
    buckets = [config.sequence_length]
    while buckets[-1] // 2 >= floor:
        buckets.append(buckets[-1] // 2)
    return tuple(sorted(buckets))


def _smallest_cover(sizes: tuple[int, ...], needed: int, too_large: str) -> int:
    """The first of ascending `sizes` that is at least `needed`."""
    for size in sizes:
        if needed <= size:
            return size
    raise NeuronConfigError(too_large)


def prefill_slices(tokens: int, chunk_size: int) -> list[slice]:
    """The pieces a prefill of `tokens` tokens runs in: chunks of chunk_size (the last may be
    shorter), or one whole piece for a standard export (chunk_size 0)."""
    step = chunk_size or tokens
    return [slice(start, min(start + step, tokens)) for start in range(0, tokens, step)]

"""An analytic roofline on trn1, not a measurement: Llama-3.1-8B bf16, TP=8 (8 NeuronCore-v2),
B decode rows + one C-token chunk per mixed step.

- Mixed step (`--mixed-step`): one graph call against TG + CP.
- Paged TG (`--kv-cache-blocks`): each row's blocks are gathered into a window before attention
  (the reference read, modeling/kv_cache.py), so the KV crosses HBM three times.
- W4 (engine_bench.py's burst: 64 prompts of 64-512 tokens, 128 out): wall time of a slot export
  (B rows) and a paged one (`--paged-rows`, same KV bytes); output tok/s only.
- Verify step (`--speculation-length K`): B rows of K + 1 tokens; with `tau` tokens a row per
  call (engine_bench.py W5), decode tok/s on / off is tau x TG ms / VF ms.
- EAGLE3 (`--speculation-head`): a decode step is VF (B rows of K + 1) then DV (the head's first
  pass over those rows and K - 1 chained steps, every pass reading the head's weights), on trn1 and
  trn2 (a rank an LNC=2 core); decode tok/s with / without is tau x TG ms / (VF + DV ms), tau the
  head's acceptance length (`--acceptance-length`, default a published figure, cited at the flag).
- 8-bit weights (`--quantization int8|fp8`): 1 byte a projection weight + a float32 scale a channel.
- fp8 KV (`--kv-cache-dtype fp8`): 1 byte a K/V value. LoRA slots (`--max-loras 4 --max-lora-rank
  16`): a decode step reads every slot's A and B too.

A graph's time: max(bytes / (bandwidth * bw_eff), flops / (peak * mfu)) + the all-reduces; a
Trainium chip is 2 NeuronCore-v2, 190 BF16 TFLOPS, 820 GiB/s HBM (AWS Neuron docs). The
efficiencies are assumptions (flags); byte and FLOP counts are exact for the shapes.

    python benchmark/neuron_projection.py [--batch 8] [--chunk 256] [--contexts 512,2048,8192]
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from host import results_folder, save

GIB = 2**30


@dataclass(frozen=True)
class Model:  # Llama-3.1-8B (config.json of meta-llama/Llama-3.1-8B)
    hidden: int = 4096
    intermediate: int = 14336
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 128256
    dtype_bytes: int = 2
    projection_bytes: int = 2  # 1: --quantization int8|fp8 (the layers' projections)
    kv_bytes: int = 2  # 1: --kv-cache-dtype fp8

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate

    @property
    def layer_channels(self) -> int:
        """Output channels of a layer's projections: one float32 scale each when quantized."""
        return self.head_dim * (self.heads + 2 * self.kv_heads) + 2 * self.hidden + 2 * self.intermediate

    def layer_bytes(self) -> int:
        scales = 4 * self.layer_channels if self.projection_bytes < self.dtype_bytes else 0
        return self.layer_params * self.projection_bytes + scales

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.kv_bytes


@dataclass(frozen=True)
class Hardware:  # trn1, per NeuronCore-v2: half a chip
    tflops: float = 95.0
    gib_s: float = 410.0
    all_reduce_us: float = 15.0  # a small all-reduce on NeuronLink (assumption)


# trn2, per logical core at LNC=2 (two NeuronCore-v3): a chip is 8 of them, 667 BF16 TFLOPS and
# 2.9 TB/s of HBM for 4 logical cores (AWS Neuron docs, Trainium2 architecture).
TRN2 = Hardware(tflops=667 / 4, gib_s=2.9e12 / 4 / GIB)


@dataclass(frozen=True)
class Head:  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (its config.json): one layer, 32000 draft tokens
    aux_layers: int = 3
    draft_vocab: int = 32000

    def params(self, m: Model, first_pass: bool) -> int:
        """fc over the aux states (first pass only), layer 0 (q / k / v read 2H), its lm_head."""
        fc = self.aux_layers * m.hidden * m.hidden if first_pass else 0
        attn = 2 * m.hidden * m.head_dim * (m.heads + 2 * m.kv_heads) + m.heads * m.head_dim * m.hidden
        return fc + attn + 3 * m.hidden * m.intermediate + m.hidden * self.draft_vocab


def graph_ms(m: Model, hw: Hardware, tp: int, rows: int, lm_rows: int, attn_tokens: list[tuple[int, int]],
             mfu: float, bw_eff: float, kv_passes: int = 1) -> dict:  # fmt: skip
    """One graph call on one core of a TP group: `rows` tokens through every layer, the LM head
    on `lm_rows`, attention of (queries, keys attended) pairs; the KV bytes cross HBM
    `kv_passes` times."""
    weight_bytes = (m.layers * m.layer_bytes() + m.hidden * m.vocab * m.dtype_bytes) / tp
    kv_bytes = kv_passes * sum(keys for _, keys in attn_tokens) * m.kv_bytes_per_token() / tp
    flops = 2 * rows * m.layers * m.layer_params / tp + 2 * lm_rows * m.hidden * m.vocab / tp
    flops += sum(4 * q * k * m.heads * m.head_dim * m.layers for q, k in attn_tokens) / tp
    memory_ms = (weight_bytes + kv_bytes) / (hw.gib_s * GIB * bw_eff) * 1e3
    compute_ms = flops / (hw.tflops * 1e12 * mfu) * 1e3
    collectives_ms = 2 * m.layers * hw.all_reduce_us / 1e3
    return dict(weights_gib=weight_bytes / GIB, kv_gib=kv_bytes / GIB, tflop=flops / 1e12,
                memory_ms=memory_ms, compute_ms=compute_ms, ms=max(memory_ms, compute_ms) + collectives_ms)  # fmt: skip


def project(m: Model, hw: Hardware, tp: int, batch: int, chunk: int, context: int, mfu: float, bw: float,
            speculation: int) -> dict:  # fmt: skip
    """A mixed step at `context` (decode rows and chunk attend over that many positions)."""
    decodes = [(1, context)] * batch
    tg = graph_ms(m, hw, tp, batch, batch, decodes, mfu, bw)
    cp = graph_ms(m, hw, tp, chunk, 1, [(chunk, context)], mfu, bw)
    fused = graph_ms(m, hw, tp, batch + chunk, batch + 1, decodes + [(chunk, context)], mfu, bw)
    paged_tg = graph_ms(m, hw, tp, batch, batch, decodes, mfu, bw, kv_passes=3)
    width = speculation + 1
    verify = graph_ms(m, hw, tp, batch * width, batch * width, [(width, context)] * batch, mfu, bw)
    separate = tg["ms"] + cp["ms"]
    return dict(context=context, tg=tg, cp=cp, fused=fused, paged_tg=paged_tg, verify=verify,
                separate_ms=separate, saved=1 - fused["ms"] / separate)  # fmt: skip


def project_w4(m: Model, hw: Hardware, tp: int, slots: int, rows: int, chunk: int, mfu: float, bw: float,
               prompts: int = 64, prompt_mean: int = 288, out_tokens: int = 128) -> dict:  # fmt: skip
    """W4's wall time on a slot export of `slots` rows against a paged one of `rows` rows."""
    context = prompt_mean + out_tokens // 2  # a decode row's mean context
    cp = graph_ms(m, hw, tp, chunk, 1, [(chunk, prompt_mean)], mfu, bw)
    prefill_s = -(-prompts * prompt_mean // chunk) * cp["ms"] / 1e3
    slot_tg = graph_ms(m, hw, tp, slots, slots, [(1, context)] * slots, mfu, bw)
    paged_tg = graph_ms(m, hw, tp, rows, rows, [(1, context)] * rows, mfu, bw, kv_passes=3)
    slot_s = prefill_s + prompts * out_tokens / slots * slot_tg["ms"] / 1e3
    paged_s = prefill_s + prompts * out_tokens / rows * paged_tg["ms"] / 1e3
    return dict(context=context, prefill_s=prefill_s, slot_tg_ms=slot_tg["ms"], paged_tg_ms=paged_tg["ms"],
                slot_s=slot_s, paged_s=paged_s, tok_s_ratio=slot_s / paged_s)  # fmt: skip


def draft_ms(m: Model, h: Head, hw: Hardware, tp: int, batch: int, k: int, context: int, mfu: float,
             bw: float) -> float:  # fmt: skip
    """DV on one core: the first pass over B rows of K + 1 tokens, then K - 1 steps of B tokens;
    each pass reads the head's weights (bf16, sharded as the target's) and its KV (one layer)."""
    passes = [(batch * (k + 1), True)] + [(batch, False)] * (k - 1)
    kv_bytes = context * 2 * m.kv_heads * m.head_dim * m.kv_bytes * batch * k / tp
    weight_bytes = sum(h.params(m, first) for _, first in passes) * m.dtype_bytes / tp
    flops = sum(2 * rows * h.params(m, first) for rows, first in passes) / tp
    memory_ms = (weight_bytes + kv_bytes) / (hw.gib_s * GIB * bw) * 1e3
    return max(memory_ms, flops / (hw.tflops * 1e12 * mfu) * 1e3) + 2 * k * hw.all_reduce_us / 1e3


def eagle3_lines(args: argparse.Namespace, contexts: list[int]) -> tuple[list[str], list[dict]]:
    m, h, k, tau, rows = Model(), Head(), args.speculation_length, args.acceptance_length, []
    lines = ["", f"EAGLE3, K={k}, acceptance length tau={tau} (tokens a row a verify call), B={args.batch}, "
             f"TP={args.tp}; trn2 a rank per LNC=2 core:", "",
             "| chip | context | TG ms | VF ms | DV ms | decode tok/s a row off / on | with / without |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for chip, hw in (("trn1", Hardware()), ("trn2", TRN2)):
        for c in contexts:
            tg = graph_ms(m, hw, args.tp, args.batch, args.batch, [(1, c)] * args.batch, args.mfu, args.bw)
            n = args.batch * (k + 1)
            vf = graph_ms(m, hw, args.tp, n, n, [(k + 1, c)] * args.batch, args.mfu, args.bw)
            dv = draft_ms(m, h, hw, args.tp, args.batch, k, c, args.mfu, args.bw)
            off, on = 1e3 / tg["ms"], tau * 1e3 / (vf["ms"] + dv)
            rows.append(dict(chip=chip, context=c, tg_ms=tg["ms"], vf_ms=vf["ms"], dv_ms=dv, off=off, on=on))
            lines.append(f"| {chip} | {c} | {tg['ms']:.2f} | {vf['ms']:.2f} | {dv:.2f} | {off:.0f} / {on:.0f} "
                         f"| **{on / off:.2f}x** |")  # fmt: skip
    return lines, rows


def mixed_lines(args: argparse.Namespace, hw: Hardware, rows: list[dict], w4: dict) -> list[str]:
    """The mixed step and paged TG table, then W4."""
    lines = [
        f"# Mixed step and paged TG on trn1, Llama-3.1-8B bf16 TP={args.tp} (analytic)", "",
        f"B={args.batch} decode rows + one {args.chunk}-token chunk; per NeuronCore-v2 {hw.tflops} TFLOPS, "
        f"{hw.gib_s} GiB/s; MFU {args.mfu}, bandwidth efficiency {args.bw}, all-reduce {hw.all_reduce_us} us.", "",
        "| context | TG ms (weights+KV GiB/core) | CP ms (TFLOP/core) | TG + CP ms | fused ms | saved "
        "| paged TG ms (KV GiB/core, 3 passes) | paged / slot TG |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        tg, cp = r["tg"], r["cp"]
        lines.append(f"| {r['context']} | {tg['ms']:.2f} ({tg['weights_gib'] + tg['kv_gib']:.2f}) | {cp['ms']:.2f} "
                     f"({cp['tflop']:.2f}) | {r['separate_ms']:.2f} | {r['fused']['ms']:.2f} | {r['saved']:.0%} "
                     f"| {r['paged_tg']['ms']:.2f} ({r['paged_tg']['kv_gib']:.2f}) | {r['paged_tg']['ms'] / tg['ms']:.2f}x |")  # fmt: skip
    return lines + [
        "", f"W4 (64 prompts of 64-512 tokens at once, 128 out; decode rows at context {w4['context']}): "
        f"prefill {w4['prefill_s']:.2f} s either way; slot export B={args.batch}: TG {w4['slot_tg_ms']:.2f} ms, "
        f"{w4['slot_s']:.2f} s; paged {args.paged_rows} rows: TG {w4['paged_tg_ms']:.2f} ms, {w4['paged_s']:.2f} s; "
        f"output tok/s paged / slots **{w4['tok_s_ratio']:.2f}x**.",
    ]  # fmt: skip


def verify_lines(args: argparse.Namespace, rows: list[dict]) -> list[str]:
    """The verify step table (decode tok/s on / off where --tokens-per-call is given)."""
    lines = [
        "", f"Verify step, {args.speculation_length + 1} tokens a row (B={args.batch}):", "",
        "| context | TG ms | VF ms | VF / TG |" + (" decode tok/s on / off |" if args.tokens_per_call else ""),
        "|---|---|---|---|" + ("---|" if args.tokens_per_call else ""),
    ]  # fmt: skip
    for r in rows:
        ratio = r["verify"]["ms"] / r["tg"]["ms"]
        gain = f" {args.tokens_per_call / ratio:.2f}x |" if args.tokens_per_call else ""
        lines.append(
            f"| {r['context']} | {r['tg']['ms']:.2f} | {r['verify']['ms']:.2f} | {ratio:.2f}x |{gain}"
        )
    return lines


def variant_lines(args: argparse.Namespace, hw: Hardware, contexts: list[int], variant: Model, title: str) -> list[str]:  # fmt: skip
    """Decode steps against `variant` (8-bit projections, fp8 KV), and what a GiB of KV holds."""
    base = Model()
    lines = ["", f"{title}, B={args.batch}:", "",
             "| context | bf16 TG ms (GiB/core) | variant TG ms (GiB/core) | decode tok/s variant / bf16 |",
             "|---|---|---|---|"]  # fmt: skip
    rows = []
    for c in contexts:
        a, b = (graph_ms(m, hw, args.tp, args.batch, args.batch, [(1, c)] * args.batch, args.mfu, args.bw)
                for m in (base, variant))  # fmt: skip
        rows.append(dict(context=c, bf16=a, variant=b, speedup=a["ms"] / b["ms"]))
        lines.append(f"| {c} | {a['ms']:.2f} ({a['weights_gib'] + a['kv_gib']:.2f}) | {b['ms']:.2f} "
                     f"({b['weights_gib'] + b['kv_gib']:.2f}) | **{a['ms'] / b['ms']:.2f}x** |")  # fmt: skip
    freed = base.layers * (base.layer_bytes() - variant.layer_bytes()) / args.tp
    return lines + ["", f"HBM freed per core: {freed / GIB:.2f} GiB; a GiB of KV holds {GIB / variant.kv_bytes_per_token():,.0f} tokens "
                    f"({GIB / base.kv_bytes_per_token():,.0f} in bf16)."], rows  # fmt: skip


def lora_lines(args: argparse.Namespace, hw: Hardware, contexts: list[int], slots: int = 4, rank: int = 16) -> list[str]:  # fmt: skip
    m, tp, cols = Model(), args.tp, slots * rank
    q, kv, h, i = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden, m.intermediate
    column = [(h, q), (h, kv), (h, kv), (h, i), (h, i)]  # A [cols, in] whole, B [cols, out] split
    row = [(q, h), (i, h)]  # A [cols, in] split, B [cols, out] whole
    per_layer = sum(cols * (a + b / tp) for a, b in column) + sum(cols * (a / tp + b) for a, b in row)
    extra = per_layer * m.layers * m.dtype_bytes  # bytes a core reads more each step
    lines = ["", f"Decode with {slots} LoRA slots of rank {rank} on every projection, B={args.batch}: "
             f"{extra / GIB * 1024:.0f} MiB more a core a step", "",
             "| context | TG ms | TG ms with slots | decode tok/s with / without |", "|---|---|---|---|"]  # fmt: skip
    for c in contexts:
        tg = graph_ms(m, hw, tp, args.batch, args.batch, [(1, c)] * args.batch, args.mfu, args.bw)
        more = tg["ms"] + extra / (hw.gib_s * GIB * args.bw) * 1e3
        lines.append(f"| {c} | {tg['ms']:.2f} | {more:.2f} | {tg['ms'] / more:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--contexts", default="512,2048,4096,8192")
    p.add_argument("--paged-rows", type=int, default=32, help="decode rows of W4's paged export")
    p.add_argument("--speculation-length", type=int, default=4, help="drafts K a verify row carries")
    p.add_argument(
        "--tokens-per-call", type=float, default=None,
        help="tokens a row emits per verify call (W5's measured figure): projects decode tok/s on / off",
    )  # fmt: skip
    p.add_argument(
        "--acceptance-length", type=float, default=2.77,
        help="EAGLE3 tokens a row per verify call; default: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B on MT-bench, "
        "K=7, temperature 1 (the model card of nebius/EAGLE3-Llama-3.3-70B-Instruct, its comparison table)",
    )  # fmt: skip
    p.add_argument(
        "--mfu", type=float, default=0.5, help="fraction of peak FLOPs a compute-bound graph reaches"
    )
    p.add_argument(
        "--bw", type=float, default=0.7, help="fraction of HBM bandwidth a memory-bound graph reaches"
    )
    p.add_argument("--results", type=Path, help="folder of the results files (default benchmark/results)")
    args = p.parse_args(argv)
    m, hw = Model(), Hardware()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [project(m, hw, args.tp, args.batch, args.chunk, c, args.mfu, args.bw, args.speculation_length)
            for c in contexts]  # fmt: skip
    w4 = project_w4(m, hw, args.tp, args.batch, args.paged_rows, args.chunk, args.mfu, args.bw)
    q_lines, q_rows = variant_lines(args, hw, contexts, replace(m, projection_bytes=1), "8-bit projections")
    kv_lines, kv_rows = variant_lines(args, hw, [4096, 8192, 16384, 32768], replace(m, kv_bytes=1), "fp8 KV")
    e_lines, e_rows = eagle3_lines(args, contexts)
    tables = [mixed_lines(args, hw, rows, w4), verify_lines(args, rows), q_lines, kv_lines, e_lines]
    lines = [line for table in tables for line in table] + lora_lines(args, hw, contexts)
    data = {
        "args": vars(args),
        "model": asdict(m),
        "rows": rows,
        "w4": w4,
        "quantized": q_rows,
        "fp8_kv": kv_rows,
        "eagle3": e_rows,
    }
    save(results_folder(args.results, smoke=False), f"neuron-projection-{datetime.date.today()}", data, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

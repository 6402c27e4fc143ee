"""`vllm serve` a chunked export (B=4, S=1024, C=128, cpu backend) against HF transformers.

Greedy tokens for prompts up to 1000 tokens alone and 8 at once, logprobs, seeds and
penalties, the start-up refusal of --max-model-len 4096, and the per-step composition the
runner logged (decodes + prefill-chunk tokens). Writes benchmark/results/serve-<date>-<host>.{json,md}.

    python benchmark/serve_parity.py [--backend cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from optimum_neuron_chunked.export.pipeline import export  # noqa: E402
from optimum_neuron_chunked.testing.checkpoints import build_checkpoint  # noqa: E402
from optimum_neuron_chunked.testing.reference import hf_greedy  # noqa: E402
from optimum_neuron_chunked.testing.server import Server  # noqa: E402

B, S, C = 4, 1024, 128
LENGTHS = (1, 127, 128, 129, 300, 640, 1000)
NEW = 16
STEP_LINE = re.compile(r"step: (\d+) decodes \+ chunks (.*)$")


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed))


def completion(http, model: str, ids: torch.Tensor, **kw) -> dict:
    body = {"model": model, "prompt": ids.tolist(), "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    resp = http.post("/v1/completions", json={**body, "return_token_ids": True, **kw})
    resp.raise_for_status()
    return resp.json()["choices"][0]


def checks(server: Server, hf) -> dict:
    import httpx

    http = httpx.Client(base_url=server.url, timeout=600)
    model = http.get("/v1/models").json()["data"][0]["id"]
    alone = {
        n: completion(http, model, prompt(n, n))["token_ids"] == hf_greedy(hf, prompt(n, n), NEW)
        for n in LENGTHS
    }

    lengths = [1000, 900, 777, 640, 513, 129, 64, 9]

    async def concurrent():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as ahttp:
            body = {
                "model": model,
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            calls = [
                ahttp.post("/v1/completions", json={**body, "prompt": prompt(n, 7 + n).tolist()})
                for n in lengths
            ]
            return [r.json()["choices"][0]["token_ids"] for r in await asyncio.gather(*calls)]

    together = asyncio.run(concurrent())
    concurrent_ok = {
        n: t == hf_greedy(hf, prompt(n, 7 + n), NEW) for n, t in zip(lengths, together, strict=True)
    }

    ids = prompt(700, 1)
    out = completion(http, model, ids, logprobs=5)
    full = torch.cat([ids, torch.tensor(out["token_ids"])])
    with torch.no_grad():
        ref = torch.log_softmax(hf(full[None]).logits[0].float(), -1)
    lp = out["logprobs"]
    worst = max(
        abs(chosen - ref[ids.shape[0] - 1 + k, token].item())
        for k, (chosen, token) in enumerate(zip(lp["token_logprobs"], out["token_ids"], strict=True))
    )
    assert all(top for top in lp["top_logprobs"])  # keyed by text: tokens that decode alike merge
    seeded = dict(temperature=0.9, seed=7)
    s1, s2 = (completion(http, model, prompt(300, 2), **seeded)["token_ids"] for _ in range(2))
    s3 = completion(http, model, prompt(300, 2), temperature=0.9, seed=8)["token_ids"]
    pen = completion(http, model, prompt(200, 3), repetition_penalty=1.5)["token_ids"]
    return {
        "greedy_alone_equals_hf": alone,
        "greedy_8_concurrent_equals_hf": concurrent_ok,
        "logprobs_max_abs_diff_vs_hf": worst,
        "seed_reproducible": s1 == s2,
        "other_seed_differs": s1 != s3,
        "repetition_penalty_equals_hf": pen == hf_greedy(hf, prompt(200, 3), NEW, repetition_penalty=1.5),
    }


def step_composition(log: str) -> dict:
    shapes = collections.Counter()
    for line in log.splitlines():
        m = STEP_LINE.search(line)
        if m:
            chunks = [] if m.group(2) == "-" else m.group(2).split()
            tokens = sum(
                int(b) - int(a) for a, b in (re.search(r"\[(\d+):(\d+)\]", c).groups() for c in chunks)
            )
            shapes[f"{m.group(1)} decodes + {len(chunks)} chunk(s) of {tokens} tokens"] += 1
    return dict(shapes.most_common(12))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument(
        "--work", type=Path, default=Path.home() / ".cache" / "optimum-neuron-chunked" / "serve-parity"
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    ckpt = build_checkpoint("demo", args.work / "checkpoint")
    out = args.work / f"export-{B}x{S // C}x{C}-{args.backend}"
    started = time.perf_counter()
    if not (out / "neuron_config.json").is_file():
        export(
            str(ckpt),
            out,
            batch_size=B,
            sequence_length=S,
            prefill_chunk_size=C,
            backend=args.backend,
            overwrite=True,
        )
    export_s = time.perf_counter() - started
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    refused = Server(out, args.work / "refused.log", "--max-model-len", "4096")
    refused_rc = refused.wait_exit()
    refusal = next((line for line in refused.output().splitlines() if "--max-model-len 4096" in line), "")

    server = Server(
        out,
        args.work / "serve.log",
        "--max-num-seqs",
        str(B),
        "--max-model-len",
        str(S),
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    ).wait_ready()
    try:
        result = checks(server, hf)
    finally:
        left = server.stop()
    result |= {
        "export": str(out),
        "export_seconds": round(export_s, 1),
        "max_model_len_4096_exit_code": refused_rc,
        "max_model_len_4096_message": refusal.strip()[-300:],
        "processes_left_after_stop": left,
        "step_composition": step_composition(server.output()),
    }
    stamp = f"{datetime.date.today()}-{platform.node()}"
    results = REPO / "benchmark" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"serve-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# vllm serve parity ({B}x{S // C}x{C}, {args.backend}) {stamp}", ""]
    md += [f"- {k}: `{v}`" for k, v in result.items() if k != "step_composition"]
    md += ["", "| step composition | steps |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in result["step_composition"].items()]
    (results / f"serve-{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    ok = all(result["greedy_alone_equals_hf"].values()) and all(
        result["greedy_8_concurrent_equals_hf"].values()
    )
    return 0 if ok and result["seed_reproducible"] and refused_rc != 0 else 1


if __name__ == "__main__":
    sys.exit(main())

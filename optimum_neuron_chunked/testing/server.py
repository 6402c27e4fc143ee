"""`vllm serve` in its own process group on a free local port, for service tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VLLM = str(Path(sys.executable).with_name("vllm"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_pids(pgid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class Server:
    def __init__(self, model: Path, log: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # The name /v1/models answers with: another test session may hold the port this one freed.
        self.name = (
            args[args.index("--served-model-name") + 1] if "--served-model-name" in args else str(model)
        )
        cmd = [VLLM, "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: engine + workers stop with it
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 240) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if self.name in [m["id"] for m in json.load(r)["data"]]:
                        return self
                time.sleep(0.5)
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vllm serve not ready after {timeout} s:\n{self.output()[-3000:]}")

    def wait_exit(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics_text(self) -> str:
        """The Prometheus text of /metrics, labels included."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """vllm:* metrics by name, labels dropped (the last sample of a name wins)."""
        values = {}
        for line in self.metrics_text().splitlines():
            if line.startswith("vllm:") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

    def stop(self, timeout: float = 60) -> list[int]:
        """SIGTERM the whole group, wait, and return the pids still alive (should be none)."""
        pgid = self.proc.pid
        if not group_pids(pgid) and self.proc.poll() is not None:
            return []
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.proc.poll() is None or group_pids(pgid)):
            time.sleep(0.2)  # poll() reaps the server: a zombie would still be in the group
        left = group_pids(pgid)
        if left:
            os.killpg(pgid, signal.SIGKILL)
        return left


def concurrent_greedy_tokens(
    url: str, model: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """All prompts sent at once (greedy, ignore_eos): each answer's token ids, in prompt order."""
    import asyncio

    from openai import AsyncOpenAI

    async def all_at_once():
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        calls = [
            client.completions.create(
                model=model,
                prompt=p,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            for p in prompts
        ]
        return [list(r.choices[0].token_ids) for r in await asyncio.gather(*calls)]

    return asyncio.run(all_at_once())


def disconnect_mid_prefill(url: str, model: str, prompt_ids: list[int], times: int) -> None:
    """Stream a completion of `prompt_ids` and hang up as soon as the headers arrive (the prefill
    still running), `times` times in a row."""
    import asyncio

    import httpx

    body = {"model": model, "prompt": prompt_ids, "max_tokens": 8, "stream": True}

    async def disconnect_early():
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(times):
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200  # headers only: the prefill is still running

    asyncio.run(disconnect_early())

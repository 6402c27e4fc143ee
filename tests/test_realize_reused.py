"""kernels.realize_reused_values: a cpu decode graph stores the RMSNorm output its linears share
instead of recomputing the norm inside each dot-product kernel (for every weight row read)."""

from __future__ import annotations

import zipfile

import torch
from torch import nn

from optimum_neuron_chunked.backends.cpu import INDUCTOR_CONFIGS, inductor_configs
from optimum_neuron_chunked.backends.cpu.kernels import kernel_choices
from optimum_neuron_chunked.backends.cpu.linear import CpuLinear
from optimum_neuron_chunked.config import NeuronConfig
from optimum_neuron_chunked.modeling.layers import RMSNorm


class NormThenProjections(nn.Module):
    """An attention block's entry as a decode graph runs it: one norm, three row-wise linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = RMSNorm(64, 1e-6)
        self.norm.weight.data.uniform_(0.5, 1.5)
        self.q, self.k, self.v = (
            CpuLinear(64, n, bias=False, rowwise_rows=8, onednn=False) for n in (64, 32, 32)
        )

    def forward(self, x):
        h = self.norm(x)
        return self.q(h), self.k(h), self.v(h)


def compiled_norm_reads(configs: dict, path) -> tuple[int, tuple[torch.Tensor, ...]]:
    """(how many loops of the generated kernels compute the norm's scale, the outputs)."""
    module, x = NormThenProjections().eval(), torch.randn(4, 64)
    with torch.no_grad():
        program = torch.export.export(module, (x,))
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=str(path), inductor_configs=configs
        )
        compiled = torch._inductor.aoti_load_package(package)
        # packaged without constants (as the backend does): bind the module's parameters
        params = dict(module.named_parameters())
        compiled.load_constants({n: params[n] for n in compiled.get_constant_fqns()}, check_full_update=True)
        outputs = compiled(x)
        want = module(x)
    for got, expected in zip(outputs, want, strict=True):
        torch.testing.assert_close(got, expected)
    with zipfile.ZipFile(package) as archive:
        kernels = "".join(archive.read(n).decode() for n in archive.namelist() if n.endswith(".kernel.cpp"))
    return kernels.count("std::sqrt") + kernels.count(".rsqrt()"), outputs


def test_the_norm_is_computed_once_for_the_linears_that_share_it(tmp_path):
    config = NeuronConfig(batch_size=4, sequence_length=64, backend="cpu")
    assert inductor_configs(config)["realize_reads_threshold"] == 0
    once, outputs = compiled_norm_reads(inductor_configs(config), tmp_path / "realized.pt2")
    inlined, inlined_outputs = compiled_norm_reads(INDUCTOR_CONFIGS, tmp_path / "inlined.pt2")
    assert once == 1
    assert inlined > once  # AOTInductor's default recomputes it in each projection's kernel
    for got, other in zip(outputs, inlined_outputs, strict=True):
        torch.testing.assert_close(got, other)


def test_the_cpu_backend_realizes_reused_values_on_every_isa():
    assert kernel_choices("AVX2").realize_reused_values
    assert kernel_choices("AVX512").realize_reused_values

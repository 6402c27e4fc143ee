"""nn.Linear as the cpu backend computes it (kernels.KernelChoices rowwise_linear_rows and
onednn_linear)."""

from __future__ import annotations

import torch
from torch import nn


class CpuLinear(nn.Linear):
    """The same parameters as nn.Linear, so the same checkpoint names and tensors:
    - up to `rowwise_rows` input rows: one dot product per (row, output feature), written so
      that AOTInductor fuses the rows into one kernel reading each weight row once;
    - more rows: oneDNN's matmul on the plain weight (`onednn`; AOTInductor calls it as an
      extern kernel on the shared weight constant, no prepacked copy), else ATen's GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rowwise_rows: int, onednn: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.rowwise_rows, self.onednn = rowwise_rows, onednn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= self.rowwise_rows:  # static: shapes are fixed when a graph is traced
            y = torch.stack([(self.weight * row).sum(-1) for row in rows.unbind(0)])
            y = y if self.bias is None else y + self.bias
        elif self.onednn:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [None], "")
        else:
            return super().forward(x)
        return y.reshape(*x.shape[:-1], self.out_features)

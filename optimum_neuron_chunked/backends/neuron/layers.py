"""The layer factory of the neuron backend: neuronx-distributed's parallel layers, with the
same sharding as modeling/parallel.py (checked there on CPU with gloo)."""

from __future__ import annotations


class NxdLayers:
    """Built inside NxDParallelState, which gives the layers their tp degree and rank."""

    def __init__(self, tp_degree: int):
        from neuronx_distributed.parallel_layers import layers

        self.tp_degree = tp_degree
        self._nxd = layers

    def column(self, in_features: int, out_features: int, bias: bool, gather_output: bool = False):
        # weight [out/tp, in]; bias sharded unless the output is gathered (then full)
        return self._nxd.ColumnParallelLinear(
            in_features, out_features, bias=bias, gather_output=gather_output
        )

    def row(self, in_features: int, out_features: int, bias: bool):
        # weight [out, in/tp]; outputs all-reduced, bias added once after
        return self._nxd.RowParallelLinear(in_features, out_features, bias=bias, input_is_parallel=True)

    def embedding(self, vocab_size: int, hidden_size: int):
        # [vocab, hidden/tp], outputs gathered: no rank-dependent vocabulary offset in the SPMD graph
        return self._nxd.ParallelEmbedding(vocab_size, hidden_size, shard_across_embedding=True)

    @staticmethod
    def quantized(linear, spec):
        """NxD's quantized layer of a Column/RowParallelLinear (quantization/quantization_layers.py,
        Release 2.29 / 0.18.0: `from_float` keeps its sharding): a `weight` in spec.storage and a
        float32 `scale` sharded as modeling/parallel.py shards it - per channel [out/tp, 1] column,
        [out, 1] replicated row; block-wise along the weight's partition dimension. Its forward
        is ours (quantization.QuantizedLinear): cast, matmul, output times scale; block-wise,
        dequantize then matmul. MoE experts are moe.Experts on every backend: NxD's quantized
        expert layers take its ExpertFused layout, not ours."""
        from neuronx_distributed.quantization import quantization_config as qc
        from neuronx_distributed.quantization.quantization_layers import (
            QuantizedColumnParallel,
            QuantizedRowParallel,
        )

        dtype = qc.QuantizedDtype.INT8 if spec.dtype == "int8" else qc.QuantizedDtype.F8E4M3
        if spec.block is None:
            q_config = qc.get_default_per_channel_custom_qconfig_dict()
        else:
            q_config = qc.get_default_blockwise_custom_qconfig_dict()
            q_config |= {"block_axis": [0, 1], "block_size": list(spec.block)}
        q_config["quantized_dtype"] = dtype
        layer = (
            QuantizedColumnParallel
            if type(linear).__name__ == "ColumnParallelLinear"
            else QuantizedRowParallel
        )
        return layer.from_float(linear, q_config)

    @staticmethod
    def reduce(x):
        # sum of the ranks' partial outputs (MoE experts split by intermediate dimension)
        from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x)

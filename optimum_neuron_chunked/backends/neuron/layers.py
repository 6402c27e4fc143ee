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
    def reduce(x):
        # sum of the ranks' partial outputs (MoE experts split by intermediate dimension)
        from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x)

"""Tensor parallelism: the engine, its exact-mode capture and collectives,
the gradient layout of sharded layers, and which layers are sharded.

The adapters of sharded linear layers live with the other adapters
(:mod:`kaisa.layers.tensor_parallel`, :mod:`kaisa.layers.megatron`).
"""

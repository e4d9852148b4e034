"""The pure core: factor specs and statistics, Kronecker math, decompositions,
the KL clip, block-diagonal layouts and per-layer state.

Nothing here knows about modules' hooks, processes or engines, and nothing
imports ``torch.distributed`` (a test checks it): every function is tensor
math on the canonical ``[batch, shared, features]`` shape, checked against a
dense float64 reference.
"""

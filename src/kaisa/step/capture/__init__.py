"""Capture: hooks that turn each call of a registered layer into factor terms.

* :mod:`~kaisa.step.capture.calls` — :class:`~kaisa.step.capture.calls.Capture`,
  the forward and tensor hooks of module calls;
* :mod:`~kaisa.step.capture.attention` — layers a module applies functionally
  (``nn.MultiheadAttention``);
* :mod:`~kaisa.step.capture.broadcast` — outputs broadcast over the batch
  (a position embedding);
* :mod:`~kaisa.step.capture.hooks` — the picklable hook objects and what they
  ask of autograd.
"""

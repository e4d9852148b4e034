"""Full-size models for planning runs (``kaisa plan --model kaisa_lab.zoo:resnet50``).

Each callable returns ``(model, example)``: a freshly initialised model and
one example input of batch 1, from which the planner counts the rows each
layer sees.  Nothing is downloaded; weights are random (only shapes matter).
"""

from __future__ import annotations

from kaisa_lab.zoo.models import bert_large, resnet50

__all__ = ["bert_large", "resnet50"]

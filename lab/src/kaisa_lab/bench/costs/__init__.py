"""The suite's cost cases (:mod:`kaisa_lab.bench.timing`), one module per question.

Importing this package registers every case in
:data:`kaisa_lab.bench.timing.TIMING_CASES`.
"""

from kaisa_lab.bench.costs import gram

__all__ = ["gram"]

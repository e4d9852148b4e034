"""Where the preconditioner sits in a job, and every collective it makes.

* :mod:`~kaisa.distributed.topology` — the data-parallel group and the groups
  holding the model's other parts;
* :mod:`~kaisa.distributed.plan` — the KAISA work plan, a pure function from
  layer sizes to who does what;
* :mod:`~kaisa.distributed.communicator` — the collectives the step runs.
"""

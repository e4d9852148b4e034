"""Where the preconditioner sits in a job, and every collective it makes.

* :mod:`~kaisa.distributed.topology` — the data-parallel group and the groups
  holding the model's other parts;
* :mod:`~kaisa.distributed.plan` — the KAISA work plan, a pure function from
  layer sizes to who does what;
* :mod:`~kaisa.distributed.communicator` — the collectives the step runs;
* :mod:`~kaisa.distributed.collectives` — the engines' gathers and process-group queries;
* :mod:`~kaisa.distributed.tensors` — FSDP2 modules, DTensor placements and shards;
* :mod:`~kaisa.distributed.schedules` — what a pipelining schedule is.

The only package that imports ``torch.distributed`` (a test checks it).
"""

"""The K-FAC step, one module per phase, in the order the data flows::

    capture        kaisa.step.capture      hooks form per-call factor terms
    reduce         kaisa.step.reduce       sums and counts onto each factor's owner
    decompose      kaisa.step.second_order owners decompose, broadcast to workers
    precondition   kaisa.step.apply        workers precondition, broadcast, KL clip,
      → scale → write back                 write the gradients back
    loss scaling   kaisa.step.loss_scaling a GradScaler's scale divided out
    non-finite     kaisa.step.nonfinite    steps with NaN/Inf gradients skipped
    schedule       kaisa.step.schedule     hyperparameters as functions of the step

:mod:`kaisa.step.pipeline` runs them, one method per phase.
"""

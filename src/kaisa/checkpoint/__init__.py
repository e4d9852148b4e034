"""Checkpoints: gathered (:mod:`~kaisa.checkpoint.state`), sharded through DCP
(:mod:`~kaisa.checkpoint.sharded`), and the factor mirror that lets rank 0
alone save every factor (:mod:`~kaisa.checkpoint.mirror`)."""

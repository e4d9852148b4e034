"""kaisa's experiment harness: the ``kaisa`` command, its training tasks and model zoo.

A distribution of its own (kaisa-lab, ``lab/`` in kaisa's repository) so that
the library, ``pip install kaisa``, needs only torch, numpy and tqdm; this one
adds scikit-learn (the digits data) and matplotlib (plots).

- :mod:`kaisa_lab.cli`: ``kaisa train | compare | plan``
- :mod:`kaisa_lab.tasks`: the built-in tasks those commands train
- :mod:`kaisa_lab.zoo`: full-size models for ``kaisa plan --model``
"""

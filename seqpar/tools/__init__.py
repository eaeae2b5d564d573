"""The tools that observe a training step from outside: the dry run, ``seqpar memory``, ``seqpar bench``
and ``seqpar plan --verify``.

They sit above everything they observe (the top tier below the ``seqpar`` command) and watch the
real step through the collectives' byte counter (:mod:`seqpar.distributed.comm_counter`), dispatch
modes and hooks; the core has no branch for them. The dry run runs the Trainer's own step function
(:func:`seqpar.train.step.run_step`).
"""

"""Training with a technique set: the step (``step``: build the stacked model and its optimizer, forward, backward,
reduce, update), the sequence split and synthetic tokens (``data``), the config file ``autotune/config-v1`` that
``best.json`` is (``config_file``), and the trainer's checkpoints and Hugging Face export (``checkpoint``).

Both the measured trial and the trainer run these. May import ``trials.core``, ``trials.kernels``,
``trials.models`` and ``trials.stack``; never ``trials.trial``, ``trials.hf`` or ``trials.train``.
"""

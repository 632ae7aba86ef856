"""The models: one ``Family`` declaration per architecture (``families``), model configs from shipped presets
(``presets/*.json``) or a user's ``config.json`` and what derives from them (``config``: windows per layer,
reduced-depth copies, parameter counts), the training model built on ``meta`` and materialised shard by shard
(``model``), and mixture-of-experts layers with routing-independent shapes (``moe``).

A new family is a ``Family(...)`` line; a new preset a JSON file. May import ``trials.core`` and
``trials.kernels``; never the stack, the step, the trial or the trainer.
"""

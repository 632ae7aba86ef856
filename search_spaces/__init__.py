"""The search spaces shipped with autotune (``*.yaml``, schema ``autotune/space-v1``; README.md says how to write
one). Data only: ``autotune.search.space`` finds the files through ``importlib.resources``."""

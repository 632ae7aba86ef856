"""The training-trial workload: model from a preset, the technique stack, a measured training step.

Usable as a library without the tuner (it never imports ``autotune``): ``trials.techniques.Techniques`` is the knob
set (each knob declared once), ``trials.rules`` its structural rules, ``trials.config_file`` reads a tuned
``best.json``, and ``trials.stack.apply(model, techniques, mesh)`` applies it to a Hugging Face Llama/Qwen model in
one's own training loop (see README).
"""

"""The training-trial workload: model from a preset, the technique stack, a measured training step.

Usable as a library: ``trials.stack.apply(model, techniques, mesh)`` applies a tuned config to a
Hugging Face Llama/Qwen model in one's own training loop (see README).
"""

"""EAGLE-1/2/3 speculative decoding, serving and draft-head training (EAGLE-3, EAGLE-1) in JAX.

The packages are layers; each imports only the ones listed before it:

    errors     one-line user errors
    models     the math: configs, parameter specs, layers, KV cache, target, draft heads
    parallel   logical axes -> mesh axes, placement, multi-host start, compiled memory plans
    io         files: Hugging Face folders, official EAGLE heads, GGUF, orbax stores, one loader
    decoding   sizing, trees, sampling, acceptance, plain and speculative decoding, mesh programs
    training   the EAGLE-3 and EAGLE-1 objectives, conversation data, train steps, runs and their checkpoints
    serving    continuous batching of speculative rows, the OpenAI-compatible API

The commands (`infer`, `train`, `convert`, `instruments`, with shared plumbing in `cli`) sit on top.
"""

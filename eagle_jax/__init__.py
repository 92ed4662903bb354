"""EAGLE-1/2/3 speculative decoding and EAGLE-3 draft-head training in JAX.

The packages are layers; each imports only the ones listed before it:

    errors     one-line user errors
    models     the math: configs, parameter specs, layers, KV cache, target, draft heads
    parallel   logical axes -> mesh axes, placement, multi-host start, compiled memory plans
    io         files: Hugging Face folders, official EAGLE heads, GGUF, orbax stores, one loader
    decoding   sizing, trees, sampling, acceptance, plain and speculative decoding, mesh programs
    training   the EAGLE-3 objective, conversation data, train steps, runs and their checkpoints

The commands (`infer`, `train`, `convert`, with shared plumbing in `cli`) sit on top.
"""

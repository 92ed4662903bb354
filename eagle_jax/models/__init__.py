"""Model math as pure functions over parameter trees: configs, parameter specs, layers, the KV cache,
target transformers and EAGLE draft heads."""

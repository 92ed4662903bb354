"""Commands that decode: the demo, generation and chat, the server, the benchmark, memory plans."""

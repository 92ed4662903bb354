"""Reading and writing model files: Hugging Face folders, official EAGLE heads, GGUF, orbax stores, and
`loading`, the one way in for any of them."""

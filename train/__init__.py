"""Commands that train draft heads (EAGLE-3, EAGLE-1) and prepare their data; the demo target's own training."""

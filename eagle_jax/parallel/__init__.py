"""Where arrays live: logical axes -> mesh axes, mesh construction and placement, multi-host start, and
memory plans checked by the compiler."""

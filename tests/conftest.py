import os

# Tests run on the CPU; keep XLA to a predictable thread count on small CI machines.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

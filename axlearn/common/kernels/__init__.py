"""GPU kernels (Pallas on Triton) for the passes XLA leaves memory-bound: backward passes
it splits into several kernels, and a decoding step's int8 matmuls."""

"""GPU kernels (Pallas on Triton) for backward passes that XLA splits into several memory-bound passes."""

"""GPU kernels (Pallas on Triton) for passes that XLA splits into several memory-bound
kernels: two backward passes of a train step, and a decoding step's attention."""

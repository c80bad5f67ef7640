"""AXLearn's flash-attention names on our stack: `layer.FlashAttention` (attention through
the cuDNN flash kernel on GPU, XLA elsewhere), its block-size modifier, and
`remat.policy`, which saves the kernel's outputs."""

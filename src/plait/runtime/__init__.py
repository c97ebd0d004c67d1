"""The runtime: executes a Plan with PyTorch's distributed stack under torchrun."""

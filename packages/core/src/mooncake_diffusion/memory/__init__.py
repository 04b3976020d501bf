"""Tensors as pointers, registration, device memory, receive pools, recycling, same-host copy."""

"""Tensors as (pointer, length, layout), register-once bookkeeping, device memory, receive
pools, recycled buffers and same-host copies.
"""

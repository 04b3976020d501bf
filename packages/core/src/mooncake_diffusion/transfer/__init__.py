"""Moving a stage's outputs: the connector over its transports (p2p, store, in-process), chunk
plans, staging, the p2p side channel, payloads and leases.
"""

"""The deterministic machine: requests, queues, pools, credits, priorities and routing, fed
events and answering actions; no I/O, no clock of its own.
"""

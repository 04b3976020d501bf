"""The deterministic machine, events in and actions out: queues, pools, credits, routing."""

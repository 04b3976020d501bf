"""The running service: the driver loop around the core, its journal, stall watch, status
tables, metrics and the bridge to a front process.
"""

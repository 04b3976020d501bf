"""The worker runtime: StageWorker, the watch for lost inputs, and toy stage functions for
tests.
"""

"""The worker runtime: StageWorker and the watch for lost inputs, with the stage
functions it serves out of the box: the reference pipeline's (what the demo runs)
and toy ones for tests.
"""

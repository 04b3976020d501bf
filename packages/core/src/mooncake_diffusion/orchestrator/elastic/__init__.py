"""Elastic pools: the planner contract, the built-in planners, the view they read, the driver
that applies their decisions, and provisioners.
"""

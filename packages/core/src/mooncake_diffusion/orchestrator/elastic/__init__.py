"""Elastic pools: the planner contract, built-in planners, their view, driver, provisioners."""

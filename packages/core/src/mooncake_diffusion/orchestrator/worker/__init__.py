"""The worker runtime, its lost-input watch, and the reference and toy stage functions."""

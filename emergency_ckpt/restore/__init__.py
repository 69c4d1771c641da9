"""Restore: what every process holds (the inventory exchange), the pure plan that picks the step and each slice's source, and its execution with fallback."""

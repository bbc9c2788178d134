"""Parallel foundation: dims, process groups, the comm module, dropout RNG."""

"""Optimizer, mixed precision, ZeRO-1, clipping, LR schedules."""

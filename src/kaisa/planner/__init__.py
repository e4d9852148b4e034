"""Planning a run before it starts: the cost model, the forecast of memory,
bytes and time per rank, and the measured rows it is sized with.

The forecast reads the same declarations the step runs on (layer adapters'
factor specs, methods' held and sent tensors, the work plan).
"""

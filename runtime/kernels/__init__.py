"""The dcp custom ops: their definitions, reference implementations and eager kernels."""

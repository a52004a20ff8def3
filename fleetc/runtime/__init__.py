"""Running a Program: generated straight-line Python per Program, state binding, memory measurement."""

"""The CPU backend: fused ops become generated C++ kernels, one loop nest each, built with the system compiler.

Which op types have CPU kernels is declared where each op is registered (`register_op(..., cpu_kernel=...)`
in fleetc/ops/); `backend.prepare` plans and builds them per Program, and this package lists their sources
for `dump-ir --kernels`.
"""

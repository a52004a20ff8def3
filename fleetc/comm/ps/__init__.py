"""Parameter-server runtime on torch.distributed.rpc (TensorPipe): roles, placement, server tables, worker client.

Servers hold the parameters (dense ones whole, embedding tables row-sharded by id) and their optimizer state,
and run the update; workers pull what a step needs and push gradients (sync / async) or parameter deltas (geo).
See docs/parameter_server.md.
"""

"""Pipeline parallelism: schedules as data (`schedule`), a process-free simulator (`simulate`), the partition of a
Program into per-stage Programs (`partition`), and an executor that runs them per a schedule in one process
(`local_executor`)."""

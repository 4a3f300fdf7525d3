"""ferry's jobs, one package each, with the same file names where a job has the step:
``plan.py`` (what would change, refused before anything does), ``run.py`` (carrying it out,
journaled), ``verify.py`` (checking the result); ``__init__.py`` names the entry points.

- :mod:`.move` — a JetStream stream to another cluster, losing nothing
- :mod:`.evacuate` — a node evacuated, a cluster rebalanced (EMQX's state machine)
- :mod:`.replicate` — streams relayed between sites; site failover and site fail-back
- :mod:`.dr_failback` — a DR RabbitMQ cluster's orphaned messages brought home
- :mod:`.partition` — subjects partitioned across streams with exact ownership
- :mod:`.copy` — streams, queues and Parquet copied on Spark
- :mod:`.proof` — load, snapshot, audit and its report: the proof that nothing was lost
- :mod:`.shared` — progress events, the capture guard, signals
"""

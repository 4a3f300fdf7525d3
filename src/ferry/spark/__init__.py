"""Spark only: the one session factory (:mod:`.session`), ferry's data sources (:mod:`.jetstream`,
:mod:`.rabbitmq`), option parsing (:mod:`.options`) and the building blocks of its Spark jobs
(:mod:`.tasks`). Broker I/O is in :mod:`ferry.brokers`; the jobs are in :mod:`ferry.jobs`."""

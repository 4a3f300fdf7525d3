"""The proof: ``ferry load`` (a known workload and its ledger), ``ferry snapshot`` (what a tier
holds, without changing it), ``ferry audit`` (the ledgers reconciled with every tier on Spark) and
its HTML report, and ``ferry topology smoke`` (a stream or queue written and read back)."""

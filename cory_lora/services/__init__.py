"""Low-level services every part may call: collectives that are no-ops on one process
(`distributed`), fault injection for the crash tests (`faults`), and the offline model cache
(`fetch`, which the engine calls on a recipe's first use of `fetched:NAME`)."""

"""`nanopipe bench <workload>` and `nanopipe profile <what>`: one tool for every measurement.

Each workload is a module of frontend.bench.workloads (or .profiles) named by one line of
frontend.bench.registry; the tool gives them the shared flags (model source, device, peer,
record) and prints and records the figures they return. Nothing here is imported by the
serving path: the engine runs without it.
"""

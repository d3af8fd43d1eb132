"""The engine front: its config, the checks made before any process starts, the pipeline
that starts and watches the actor processes, the offline `LLM` and the `nanopipe` CLI."""

"""The frontend's actor processes: the tokenizer, the detokenizer and the stdout printer,
with what only they use (size bounds, validation, the tokenize pool, incremental decoding).
Each runs as `python -m frontend.actors.<name>`, started by the engine's pipeline."""

"""The OpenAI-compatible HTTP server, a client of the pipeline like any other: request models
(`schema`), response bodies (`responses`), errors (`errors`), the body size limit
(`body_limit`), answering a request (`streaming`), the routes (`app`) and the entry (`server`)."""

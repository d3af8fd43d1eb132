"""The OpenAI-compatible HTTP server (`server`) and its request/response schema (`schema`);
a client of the pipeline like any other."""

"""An OpenAI-compatible HTTP API over the cluster's language models (serve-hmp jobs): the request and answer shapes
(``openai_api``) and the server (``server``); the gateway service is the adapter between it and the bus."""

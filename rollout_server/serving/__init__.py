"""Serving: the HTTP surface: the app and its lifespan (serve.py starts it), the learner's routes, the
OpenAI-compatible, token and generate routes, how that traffic shares the engine with production
(traffic.py), the request guard and the metrics."""

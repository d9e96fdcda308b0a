"""Environments from outside tandem: a `verifiers` taskset, run by its own harness (verifiers_runner.py)
against this server's OpenAI API, and the renderer that keeps its episodes token-exact."""

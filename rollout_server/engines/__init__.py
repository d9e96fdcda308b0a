"""Engines: what samples and scores tokens behind the RolloutBackend seam (base.py): vLLM in this process
(vllm.py, with merged weights in vllm_merge.py), Hugging Face (hf.py), or vLLM servers the user runs
(external.py). An engine never imports production or serving."""

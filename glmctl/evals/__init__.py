"""Quality and speed checks against a live OpenAI-compatible (vLLM) server.

    client.py      the HTTP client (httpx): models, /tokenize, prompt_logprobs, completions, /metrics
    tokenizer.py   the model's tokenizer, from the server or a checkpoint directory
    corpus.py      source text: a fixed slice of Python's stdlib, or the user's files
    perplexity.py  strided-window perplexity, bits per byte, paired baselines (stats.py)
    needle.py      needle cells: generation, placement, recipes, scoring; needle_run.py runs a grid
    kld.py         KL divergence vs the exact model: kld_table.py (plan, top-K tables), kld_math.py (the bound)
    humaneval.py   HumanEval pass@k: sandbox.py (+ sandbox_boot.py) runs programs, humaneval_stats.py
    jsonl_log.py   resumable JSONL results (kld, humaneval)
    serving_bench.py concurrent sessions; bench_drive.py streams them, metrics.py finds the steady window
    results.py     result files (--out / --baseline); target.py picks or starts the server
"""

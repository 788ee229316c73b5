"""``ledger engine serve``: the reference engine behind an OpenAI-compatible API that
returns token IDs the way vLLM does (``return_token_ids``). Imports torch (through the
engine); nothing in ``ledger`` imports this package except the CLI command, lazily."""

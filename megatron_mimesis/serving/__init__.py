"""Serving a trained simulator to other people's clients (beside ``vllm serve`` of an export)."""

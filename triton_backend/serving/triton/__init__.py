"""Triton's Python-backend models (what model_repo/*/1/model.py loads), their metrics and response fencing."""

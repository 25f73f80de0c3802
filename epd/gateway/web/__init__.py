"""The web demo: static page + the JSON endpoints it needs (routes.py)."""

"""pdserve's settings: their schema (schema.py) and where they are read from (loading.py)."""

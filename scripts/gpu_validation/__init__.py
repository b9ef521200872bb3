"""The GPU validation kit (scripts/gpu_validate.py): items, their verdicts, the runner. Standard library only."""

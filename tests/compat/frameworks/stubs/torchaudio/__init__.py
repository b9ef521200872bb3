"""An empty ``torchaudio`` for LLaMA-Factory 0.9.5, which imports it unconditionally (``data/mm_plugin.py``)
but uses it only for audio inputs. No torchaudio release loads with torch 2.13.0, and a mismatched one
would pull another torch; the compatibility runner puts this directory on ``PYTHONPATH`` for
LLaMA-Factory only. Text-only training never touches it."""

"""Pieces the bench scripts share (not scripts: ``tests/e2e/test_bench_scripts.py`` runs only
``bench/*.py``)."""

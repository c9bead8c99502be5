"""Tests of kvpool's vLLM integration that run vLLM itself, in the side venv
(tests/vllm/setup_venv.sh makes it)."""

"""Tests of kvfail.harness (vLLM's real Scheduler driven on CPU)."""

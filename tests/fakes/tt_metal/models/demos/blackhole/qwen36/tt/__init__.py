"""Mirrors tt-metal's package models/demos/blackhole/qwen36/tt/ (only qwen36_vllm.py is faked here)."""

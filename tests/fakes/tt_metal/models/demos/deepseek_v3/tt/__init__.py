"""Mirrors tt-metal's package models/demos/deepseek_v3/tt/ (only generator_vllm.py is faked here)."""

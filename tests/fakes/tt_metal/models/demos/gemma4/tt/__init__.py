"""Mirrors tt-metal's package models/demos/gemma4/tt/ (only generator_vllm.py is faked here)."""

"""Mirrors tt-metal's package models/demos/qwen3_vl/ (only the modules ttserve imports from it are faked here)."""

"""Mirrors tt-metal's package models/demos/blackhole/qwen36/ (only the modules ttserve imports from it are faked here)."""

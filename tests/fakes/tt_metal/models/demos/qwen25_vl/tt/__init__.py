"""Mirrors tt-metal's package models/demos/qwen25_vl/tt/ (only the modules ttserve imports from it are faked here)."""

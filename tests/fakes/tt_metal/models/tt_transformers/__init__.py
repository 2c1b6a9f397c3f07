"""Mirrors tt-metal's package models/tt_transformers/ (only the modules ttserve imports from it are faked here)."""

"""Mirrors tt-metal's package models/tt_transformers/tt/ (only the modules ttserve imports from it are faked here)."""

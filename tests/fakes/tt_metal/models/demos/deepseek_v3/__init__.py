"""Mirrors tt-metal's package models/demos/deepseek_v3/ (only the modules ttserve imports from it are faked here)."""

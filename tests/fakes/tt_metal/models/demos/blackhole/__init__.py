"""Mirrors tt-metal's package models/demos/blackhole/ (only the modules ttserve imports from it are faked here)."""

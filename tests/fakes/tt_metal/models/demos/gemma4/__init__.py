"""Mirrors tt-metal's package models/demos/gemma4/ (only the modules ttserve imports from it are faked here)."""

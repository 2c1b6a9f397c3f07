"""Mirrors tt-metal's package models/demos/ (only the modules ttserve imports from it are faked here)."""

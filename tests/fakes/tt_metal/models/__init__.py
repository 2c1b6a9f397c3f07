"""Mirrors tt-metal's package models/ (only the modules ttserve imports from it are faked here)."""
